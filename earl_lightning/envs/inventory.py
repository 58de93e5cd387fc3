"""A tool task where choosing the tool matters: look a number up in a small inventory table.

Each seed draws a table of items (a price, a stock count and a weight each) and asks for one field
of one item. Three tools read the table, ``price(item)``, ``stock(item)`` and ``weight(item)``;
only the one the question asks for gives the answer, and the numbers are drawn afresh every
episode, so they cannot be learned by heart. The answer is a message holding the number.
"""

from __future__ import annotations

import random
import re

from earl_lightning.core.checks import check_count, check_number
from earl_lightning.envs.base import StepResult, register_env
from earl_lightning.envs.parsing import build_env, read_int

ITEMS = (
    "apples",
    "bananas",
    "cherries",
    "dates",
    "figs",
    "grapes",
    "kiwis",
    "lemons",
    "limes",
    "mangoes",
    "melons",
    "oranges",
    "pears",
    "plums",
    "peaches",
    "apricots",
)
FIELDS = ("price", "stock", "weight")
QUESTIONS = {
    "price": "What does one {} cost?",
    "stock": "How many {} are in stock?",
    "weight": "How much does one {} weigh?",
}
_INTEGER = re.compile(r"\s*([+-]?\d+)\s*")


class InventoryEnv:
    """Answer a question about one item of a small table, with three look-up tools.

    Args:
        num_items: items in each episode's table (at most 16).
        max_tool_calls: tool calls allowed; later ones answer with an error.
        correct_reward / wrong_reward: reward for a right / wrong answer.
        invalid_reward: reward when the final message is not an integer (``invalid_action``).

    ``info``: ``correct``, ``tool_calls`` and ``right_tool`` (whether the first tool called was
    the one the question asks for; None when no tool was called).
    """

    def __init__(
        self,
        num_items: int = 8,
        max_tool_calls: int = 3,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        invalid_reward: float = -1.0,
    ) -> None:
        self.num_items = check_count("num_items", num_items, 0)
        if not 1 <= self.num_items <= len(ITEMS):
            raise ValueError(f"`num_items` must be in [1, {len(ITEMS)}], got {num_items!r}")
        self.max_tool_calls = check_count("max_tool_calls", max_tool_calls, 0)
        self.correct_reward = check_number("correct_reward", correct_reward)
        self.wrong_reward = check_number("wrong_reward", wrong_reward)
        self.invalid_reward = check_number("invalid_reward", invalid_reward)
        self.table: dict[str, dict[str, int]] = {}
        self.asked, self.item = "price", ITEMS[0]
        self.first_tool: str | None = None
        self._calls = 0

    def reset(self, seed: int) -> str:
        rng = random.Random(check_count("seed", seed, 0))
        names = rng.sample(ITEMS, self.num_items)
        self.table = {n: {f: rng.randint(1, 99) for f in FIELDS} for n in names}
        self.item, self.asked = rng.choice(names), rng.choice(FIELDS)
        self.first_tool, self._calls = None, 0
        return QUESTIONS[self.asked].format(self.item) + " Answer with the number."

    @property
    def answer(self) -> int:
        return self.table[self.item][self.asked]

    def tools(self) -> list:
        return [self.price, self.stock, self.weight]

    def price(self, item: str) -> str:
        """The price of one item, in cents.

        Args:
            item: the item's name, e.g. "apples".
        """
        return self._look_up("price", item)

    def stock(self, item: str) -> str:
        """How many of an item are in stock.

        Args:
            item: the item's name, e.g. "apples".
        """
        return self._look_up("stock", item)

    def weight(self, item: str) -> str:
        """The weight of one item, in grams.

        Args:
            item: the item's name, e.g. "apples".
        """
        return self._look_up("weight", item)

    def _look_up(self, field: str, item: str) -> str:
        self._calls += 1
        if self.first_tool is None:
            self.first_tool = field
        if self._calls > self.max_tool_calls:
            return f"Error: no tool calls left (at most {self.max_tool_calls})"
        row = self.table.get(item.strip().lower())
        if row is None:
            return f"Error: no item {item!r}; the items are {sorted(self.table)}"
        return str(row[field])

    def step(self, action: str) -> StepResult:
        info = {
            "tool_calls": self._calls,
            "right_tool": None if self.first_tool is None else self.first_tool == self.asked,
        }
        match = _INTEGER.fullmatch(action)
        number = None if match is None else read_int(match.group(1))
        if number is None:
            return StepResult(
                "Invalid: answer with the number.",
                self.invalid_reward,
                True,
                {**info, "invalid_action": True, "correct": False},
            )
        correct = number == self.answer
        return StepResult(
            "Correct." if correct else f"Wrong, the answer is {self.answer}.",
            self.correct_reward if correct else self.wrong_reward,
            True,
            {**info, "invalid_action": False, "correct": correct},
        )


@register_env("inventory")
def _make_inventory(**kwargs) -> InventoryEnv:
    return build_env(InventoryEnv, "inventory", kwargs)

"""A multi-turn tool-use task: answer an arithmetic question, optionally calling a calculator.

``protocol="tools"`` (the default): the calculator is a real tool, ``calculate(expression)``,
offered to the model through the chat template (``ToolEnv.tools()``); the model calls it in its
own format (``--model.rollout.tool_parser``), reads the result in a ``tool`` message, and answers
with a message holding the number. ``protocol="text"``: the first version's private protocol, the
agent writes ``calc(<expr>)`` to get ``calc: <result>`` back as a user message and ``answer(N)`` to
finish. The calculator evaluates a parsed ``ast`` over integers with ``+ - * / // % **`` and
parentheses only: never ``eval``, no names, no calls, no attributes, and small exponents and
bounded numbers, so a model cannot make the env hang or run code.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Literal

from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.envs.base import StepResult, register_env
from earl_lightning.envs.parsing import build_env, find_call, read_int

MAX_EXPR_CHARS = 200
MAX_EXPONENT = 16
# Bounds numerators and denominators, so that repeated powers cannot blow up time or memory.
MAX_ABS = 10**18

_BINOPS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """A bad calculator expression; the message is shown to the agent."""


def safe_eval(expr: str) -> Fraction:
    """Evaluate an integer arithmetic expression exactly (``/`` gives a fraction).

    Raises ``CalcError`` for anything outside ``+ - * / // % **``, parentheses and integer
    literals, for exponents above ``MAX_EXPONENT`` in size, for numbers beyond ``MAX_ABS`` and
    for division by zero.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError) as err:
        raise CalcError("not an arithmetic expression") from err
    try:
        return _eval(tree.body)
    except ZeroDivisionError as err:
        raise CalcError("division by zero") from err


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise CalcError(f"only integers are allowed, got {node.value!r}")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) is ast.Pow:
        return _power(_eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _bounded(_BINOPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise CalcError(f"unsupported syntax {type(node).__name__}; use + - * / // % ** and ()")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalcError(
            f"exponent must be an integer of size at most {MAX_EXPONENT}, got {exponent}"
        )
    # Checked before computing: a bounded base to a small exponent is at most ~1e288, cheap.
    return _bounded(base ** int(exponent))


def _bounded(value: Fraction | int) -> Fraction:
    if abs(value.numerator) > MAX_ABS or value.denominator > MAX_ABS:
        raise CalcError("number too large")
    return Fraction(value)  # Fraction // Fraction is an int


def format_number(value: Fraction) -> str:
    """Integers exactly; other fractions as a decimal with 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".10g")


# (template, number range) per difficulty; templates are filled left to right.
_TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[int, int]]] = {
    "easy": (("{}+{}", "{}-{}", "{}*{}"), (2, 20)),
    "medium": (("{}*{}+{}", "{}*{}-{}", "{}+{}*{}"), (10, 99)),
    "hard": (("({}+{})*{}-{}", "{}*{}*{}+{}", "({}-{})*({}+{})"), (10, 999)),
}
_INTEGER = re.compile(r"\s*([+-]?\d+)\s*")


def _number(text: str) -> int | None:
    """The integer ``text`` is, or None (an invalid answer): not an integer, or too long (:func:`read_int`)."""
    number = _INTEGER.fullmatch(text)
    return None if number is None else read_int(number.group(1))


def make_question(seed: int, difficulty: str) -> tuple[str, int]:
    """A deterministic ``(expression, answer)`` for this seed and difficulty."""
    rng = random.Random(seed)
    templates, (lo, hi) = _TEMPLATES[difficulty]
    template = rng.choice(templates)
    expr = template.format(*(rng.randint(lo, hi) for _ in range(template.count("{}"))))
    return expr, int(safe_eval(expr))


class CalculatorEnv:
    """Answer an arithmetic question, with a calculator tool.

    Args:
        max_tool_calls: calculator calls allowed; one more ends the episode with ``wrong_reward``
            and ``info["truncated_tools"] = True`` (``tools``: the tool answers with an error).
        difficulty: ``"easy"`` (a op b, up to 20), ``"medium"`` (a*b+c, two digits),
            ``"hard"`` (four numbers up to 999).
        correct_reward / wrong_reward: reward for a right / wrong ``answer(N)``.
        invalid_reward: reward when the text has neither a ``calc(...)`` nor an ``answer(N)``
            with an integer N (``tools``: a final message that is not an integer; ends the episode,
            ``info["invalid_action"] = True``).
        protocol: ``tools`` (the calculator a tool, the answer a message) or ``text`` (``calc(...)``
            and ``answer(N)`` written in the text).

    ``info["tool_calls"]`` counts the ``calc`` calls made so far (the refused one included), and
    ``info["correct"]`` tells whether the final answer was right.
    """

    def __init__(
        self,
        max_tool_calls: int = 3,
        difficulty: Literal["easy", "medium", "hard"] = "easy",
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        invalid_reward: float = -1.0,
        protocol: Literal["tools", "text"] = "tools",
    ) -> None:
        self.max_tool_calls = check_count("max_tool_calls", max_tool_calls, 0)
        self.difficulty = check_choice("difficulty", difficulty, tuple(_TEMPLATES))
        self.correct_reward = check_number("correct_reward", correct_reward)
        self.wrong_reward = check_number("wrong_reward", wrong_reward)
        self.invalid_reward = check_number("invalid_reward", invalid_reward)
        self.protocol = check_choice("protocol", protocol, ("tools", "text"))
        self.question, self.answer = "", 0
        self._calls = 0
        self._done = True

    def reset(self, seed: int) -> str:
        self.question, self.answer = make_question(check_count("seed", seed, 0), self.difficulty)
        self._calls = 0
        self._done = False
        if self.protocol == "tools":
            return f"What is {self.question}? Answer with the number."
        return (
            f"What is {self.question}? Use calc(expr) for a calculator, then answer with answer(N)."
        )

    def tools(self) -> list:
        """The calculator tool (``tools`` protocol; none for ``text``)."""
        return [self.calculate] if self.protocol == "tools" else []

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: integers with + - * / // % ** and parentheses.
        """
        self._calls += 1
        if self._calls > self.max_tool_calls:
            return f"Error: no calculator calls left (at most {self.max_tool_calls})"
        try:
            return format_number(safe_eval(expression))
        except CalcError as err:
            return f"Error: {err}"

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset(seed) first")
        if self.protocol == "tools":
            return self._final(action)
        call = find_call(action, ("calc", "answer"))
        if call is not None and call[0] == "calc":
            return self._calc(call[1])
        number = _number(call[1]) if call is not None else None
        if number is None:
            return self._end(
                "Invalid: use calc(expr) or answer(N).", self.invalid_reward, invalid_action=True
            )
        correct = number == self.answer
        text = "Correct." if correct else f"Wrong, the answer is {self.answer}."
        return self._end(
            text, self.correct_reward if correct else self.wrong_reward, correct=correct
        )

    def _final(self, text: str) -> StepResult:
        """``tools``: the model's message without a tool call is its answer, a bare integer."""
        number = _number(text)
        if number is None:
            return self._end(
                "Invalid: answer with the number.", self.invalid_reward, invalid_action=True
            )
        correct = number == self.answer
        return self._end(
            "Correct." if correct else f"Wrong, the answer is {self.answer}.",
            self.correct_reward if correct else self.wrong_reward,
            correct=correct,
            truncated_tools=self._calls > self.max_tool_calls,
        )

    def _calc(self, expr: str) -> StepResult:
        self._calls += 1
        if self._calls > self.max_tool_calls:
            return self._end(
                f"Too many calc calls (max {self.max_tool_calls}).",
                self.wrong_reward,
                truncated_tools=True,
                correct=False,
            )
        try:
            text = f"calc: {format_number(safe_eval(expr))}"
        except CalcError as err:
            text = f"calc error: {err}"
        return StepResult(text, 0.0, False, {"invalid_action": False, "tool_calls": self._calls})

    def _end(self, text: str, reward: float, *, invalid_action: bool = False, **info) -> StepResult:
        self._done = True
        return StepResult(
            text,
            reward,
            True,
            {"invalid_action": invalid_action, "tool_calls": self._calls, **info},
        )


@register_env("calculator")
def _make_calculator(**kwargs) -> CalculatorEnv:
    return build_env(CalculatorEnv, "calculator", kwargs)

"""A user's own tools and a tool environment, reached by import path (``--data.tools
'[tests.plugins.tools.add]'``), written as for TRL's ``tools=`` / ``environment_factory``."""

from __future__ import annotations

import asyncio
import re
import threading
import time

from earl_lightning.envs.base import StepResult

_INT = re.compile(r"-?\d+")
CALLS: list[tuple[str, float, float]] = []  # (tool, start, end) of every call of `nap`
RELEASE = threading.Event()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def nap(seconds: float, tag: str = "") -> str:
    """Sleep, then say so (a slow tool).

    Args:
        seconds: how long.
        tag: a label for the call.
    """
    start = time.perf_counter()
    time.sleep(seconds)
    CALLS.append((tag, start, time.perf_counter()))
    return f"slept {seconds:g}"


async def anap(seconds: float) -> str:
    """Sleep without a thread (an async tool).

    Args:
        seconds: how long.
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds:g}"


def hang(label: str) -> str:
    """Never returns until the test releases it.

    Args:
        label: anything.
    """
    RELEASE.wait(120)
    return "released"


def match(text: str) -> str:
    """Whether the text matches (a+)+b; a long run of a's without a b backtracks for ever in the C
    regex engine, holding the GIL all the while.

    Args:
        text: the text.
    """
    return "yes" if re.match(r"(a+)+b", text) else "no"


class Counter:
    """A tool environment: the model counts up with its ``increment`` tool, then says the total;
    ``step`` grades the final answer against the row's ``target`` (reward 1.0 when right)."""

    def reset(self, seed: int, target: int = 3) -> str:
        self.total, self.target = 0, int(target)
        return f" Count to {self.target}."

    def tools(self) -> list:
        return [self.increment]

    def increment(self, by: int = 1) -> int:
        """Add to the running total and return it.

        Args:
            by: how much to add.
        """
        self.total += by
        return self.total

    def step(self, action: str) -> StepResult:
        m = _INT.search(action)
        right = m is not None and int(m.group()) == self.total == self.target
        return StepResult(
            "", 1.0 if right else 0.0, True, {"correct": right, "tool_calls": self.total}
        )


class HoldsTheGil:
    """``step`` on the given turn runs a regular expression that backtracks for hours inside the C
    engine, holding the GIL all the while (a thread cannot even be timed out); other steps answer."""

    def __init__(self, bad_seed: int = 0) -> None:
        self.bad_seed = bad_seed

    def reset(self, seed: int) -> str:
        self.seed = seed
        return "Say something."

    def step(self, action: str) -> StepResult:
        if self.seed == self.bad_seed:
            re.match(r"(a+)+b", "a" * 64)
        return StepResult("", 1.0, True, {})


class Sleepy:
    """A tool environment (its ``nap`` tool) whose every step takes 0.05 s x (seed % 3): episodes
    whose calls return at different times, for continuous turns."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, seed: int) -> str:
        self.seed, self.turn = seed, 0
        return "Say anything."

    def tools(self) -> list:
        return [nap]

    def step(self, action: str) -> StepResult:
        time.sleep(0.05 * (self.seed % 3))
        self.turn += 1
        return StepResult("Again.", 0.0, self.turn >= self.turns, {})


def flood(size: int) -> str:
    """A result of ``size`` characters (a tool that answers with far too much text).

    Args:
        size: how many characters.
    """
    return "x" * size


def raising_parser(text: str):
    """A user's tool-call parser with a bug: it raises on every turn that mentions a call."""
    from earl_lightning.tasks.tool_parsers import ParsedTurn

    if "call" in text:
        raise RuntimeError("this parser is broken")
    return ParsedTurn()


def untyped_parser(text: str):
    """A user's tool-call parser that returns a dict instead of a ParsedTurn for a call."""
    from earl_lightning.tasks.tool_parsers import ParsedTurn

    return {"calls": [text]} if "call" in text else ParsedTurn()


def bignum(digits: int) -> int:
    """A number of ``digits`` + 1 digits (past Python's int-to-text limit of 4,300).

    Args:
        digits: its power of ten.
    """
    return 10**digits


def deep(levels: int) -> list:
    """Lists nested ``levels`` deep (past Python's stack when written as JSON).

    Args:
        levels: how deep.
    """
    out: list = []
    for _ in range(levels):
        out = [out]
    return out

"""Helpers shared by the built-in environments: reading actions out of model text, the seat
setting, and building an env from YAML keywords (numbers and seeds: ``earl_lightning.core.checks``).

Pure Python: no torch, no OpenSpiel, no TextArena, so every env module can import it cheaply.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union

E = TypeVar("E")

Seat = Union[Literal["alternate"], int]  # noqa: UP007 - an alias jsonargparse reads at run time

_FIRST_INT = re.compile(r"\d+")


# Python refuses to read an int of more than 4,300 digits (sys.int_info), and raising inside an env
# counts as the env's failure; a number in an action is an answer or an action id, far shorter.
MAX_DIGITS = 100


def read_int(text: str) -> int | None:
    """``text`` (an optional sign and decimal digits) as an int; ``None`` when it is not one or has
    more than ``MAX_DIGITS`` digits (leading zeros aside): the action is then an invalid one."""
    text = text.strip()
    digits = text.lstrip("+-")
    body = digits.lstrip("0") or "0"
    if not digits.isdecimal() or len(text) - len(digits) > 1 or len(body) > MAX_DIGITS:
        return None
    return -int(body) if text.startswith("-") else int(body)


def first_int(text: str) -> int | None:
    """The first run of decimal digits in ``text`` as an int, or ``None`` if there is none or it is
    too long to be an action (:func:`read_int`).

    A leading minus sign is ignored on purpose: the games' action ids are non-negative, and a
    small model that writes ``-3`` most likely meant column 3.
    """
    match = _FIRST_INT.search(text)
    return read_int(match.group()) if match else None


def find_call(text: str, names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first ``name(...)`` call in ``text`` for one of ``names``, as ``(name, argument)``.

    The argument runs to the matching closing parenthesis, so ``calc((2+3)*4)`` yields
    ``"(2+3)*4"``. An unbalanced call (no matching ``)``) takes the rest of the text; the caller
    decides whether that argument makes sense. ``None`` when no call to any name is present.
    """
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in names) + r")\s*\(")
    match = pattern.search(text)
    if match is None:
        return None
    start, depth = match.end(), 1
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return match.group(1), text[start:i]
    return match.group(1), text[start:]


def check_seat(seat: object, arg: str = "seat") -> Seat:
    """Validate a seat setting: ``"alternate"`` or a player index 0 / 1."""
    if seat == "alternate" or (type(seat) is int and seat in (0, 1)):
        return seat  # type: ignore[return-value]
    raise ValueError(f"`{arg}` must be 'alternate', 0 or 1, got {seat!r}")


def agent_player(seat: Seat, seed: int) -> int:
    """The player index the agent takes for this episode.

    ``"alternate"`` gives the first move to the agent on even seeds and to the opponent on odd
    ones, so a batch of consecutive seeds trains both seats equally.
    """
    if seat == "alternate":
        return seed % 2
    return int(seat)


def build_env(
    factory: Callable[..., E], env: str, kwargs: dict[str, Any], fixed: tuple[str, ...] = ()
) -> E:
    """Call ``factory(**kwargs)``, turning a misspelt keyword into a ValueError that lists the
    valid ones (``env_kwargs`` come from YAML, where a typo would otherwise be a bare TypeError).
    ``fixed`` names parameters the registered name already decides."""
    valid = sorted(set(inspect.signature(factory).parameters) - set(fixed))
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown} for env {env!r}; valid: {valid}")
    return factory(**kwargs)

"""The scalar argument checks every layer shares: counts, numbers and choices.

Each error names the argument as the caller wrote it (``arg``: ``"max_turns"``,
``"--algorithm.clip_low"``), the bad value (``!r``) and what is allowed. A bool is never a number
here, although Python counts it as an int. The checkers return the value, so a caller may write
``self.n = check_count("n", n)``. Imports nothing from the package (tier 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def is_int(value: object) -> bool:
    """``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """``value`` is a finite int or float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_count(
    arg: str, value: Any, low: int = 1, *, optional: bool = False, unit: str = ""
) -> int:
    """``value`` is an int >= ``low`` (or None when ``optional``); ``unit`` follows the allowed range
    in the error (``" (the adapters' rank)"``)."""
    if (optional and value is None) or (is_int(value) and value >= low):
        return value
    what = "a positive integer" if low == 1 else f"an integer >= {low}"
    raise ValueError(f"`{arg}` must be {what}{unit}{_or_none(arg, optional)}, got {value!r}")


def check_number(
    arg: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    strict: bool = False,
    strict_high: bool = False,
    optional: bool = False,
    unit: str = "",
) -> float:
    """``value`` is a finite number (not a bool) with ``low <= value <= high`` where given
    (``strict``: ``low < value``; ``strict_high``: ``value < high``), or None when ``optional``.
    ``unit`` follows the allowed range in the error (``" of seconds"``, ``" (why)"``)."""
    if optional and value is None:
        return value
    ok = is_real(value)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if ok and high is not None:
        ok = value < high if strict_high else value <= high
    if ok:
        return float(value)
    what = _range(low, high, strict, strict_high)
    raise ValueError(f"`{arg}` must be {what}{unit}{_or_none(arg, optional)}, got {value!r}")


def _range(low: float | None, high: float | None, strict: bool, strict_high: bool) -> str:
    if low is None and high is None:
        return "a finite number"
    if high is None:
        return (
            "a positive number"
            if low == 0 and strict
            else f"a number {'>' if strict else '>='} {low:g}"
        )
    if low is None:
        return f"a number {'<' if strict_high else '<='} {high:g}"
    return f"a number in {'(' if strict else '['}{low:g}, {high:g}{')' if strict_high else ']'}"


def _or_none(arg: str, optional: bool) -> str:
    """How an optional argument's "unset" is written: ``null`` for a recipe's or the command
    line's setting (``--model...``), ``None`` for a Python argument."""
    if not optional:
        return ""
    return " or null" if arg.startswith("--") else " or None"


def check_choice(arg: str, value: T, allowed: Iterable[Any]) -> T:
    """``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"`{arg}` must be one of {allowed}, got {value!r}")
    return value

"""earl_lightning.core.checks: the scalar argument checks, their wording and what they let through."""

from __future__ import annotations

import pytest

from earl_lightning.core.checks import check_choice, check_count, check_number, is_int, is_real


def test_bools_are_not_numbers():
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_real(2.5) and is_real(-1) and not is_real(False) and not is_real(float("nan"))
    assert not is_real(float("inf")) and not is_real("1")


def test_counts():
    assert check_count("n", 3) == 3
    assert check_count("n", 0, 0) == 0
    assert check_count("n", None, optional=True) is None
    with pytest.raises(ValueError, match=r"^`n` must be a positive integer, got True$"):
        check_count("n", True)
    with pytest.raises(ValueError, match=r"^`n` must be an integer >= 0 or None, got 2.5$"):
        check_count("n", 2.5, 0, optional=True)
    with pytest.raises(ValueError, match=r"^`r` must be a positive integer \(rank\), got 0$"):
        check_count("r", 0, unit=" (rank)")
    # a recipe's or the command line's setting is unset with null, a Python argument with None
    with pytest.raises(ValueError, match=r"^`--data.n` must be a positive integer or null, got 0$"):
        check_count("--data.n", 0, optional=True)


@pytest.mark.parametrize(
    "kwargs, value, allowed",
    [
        (dict(), float("nan"), "a finite number"),
        (dict(low=0, strict=True), 0, "a positive number"),
        (dict(low=0), -1, "a number >= 0"),
        (dict(low=1, strict=True), 1, "a number > 1"),
        (dict(high=2), 3, "a number <= 2"),
        (dict(low=0, high=1), 1.5, "a number in [0, 1]"),
        (dict(low=0, high=1, strict=True), 0, "a number in (0, 1]"),
        (dict(low=0, high=1, strict_high=True), 1.0, "a number in [0, 1)"),
        (dict(low=0, strict=True, optional=True, unit=" of seconds"), True, None),
    ],
)
def test_number_errors_name_the_argument_the_value_and_the_range(kwargs, value, allowed):
    allowed = allowed or "a positive number of seconds or None"
    with pytest.raises(ValueError) as err:
        check_number("x", value, **kwargs)
    assert str(err.value) == f"`x` must be {allowed}, got {value!r}"


def test_numbers_pass_through_as_floats():
    assert check_number("x", 2, low=0) == 2.0 and isinstance(check_number("x", 2), float)
    assert check_number("x", None, optional=True) is None


def test_choices():
    assert check_choice("mode", "a", ("a", "b")) == "a"
    assert check_choice("mode", None, (None, "a")) is None
    with pytest.raises(ValueError, match=r"^`mode` must be one of \['a', 'b'\], got 'c'$"):
        check_choice("mode", "c", ("a", "b"))

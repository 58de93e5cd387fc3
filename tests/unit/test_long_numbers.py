"""A number too long for Python to read (over 4,300 digits) in a model's action is an invalid
action of the env, not an exception that counts as the env's failure (issue 45)."""

from __future__ import annotations

import pytest

from earl_lightning.envs import CalculatorEnv, InventoryEnv, OpenSpielEnv
from earl_lightning.envs.parsing import MAX_DIGITS, first_int, read_int

HUGE = "7" * 5_000


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("-42", -42),
        ("+7", 7),
        (" 0 ", 0),
        ("0" * 5_000 + "5", 5),
        ("9" * MAX_DIGITS, int("9" * MAX_DIGITS)),
        ("9" * (MAX_DIGITS + 1), None),
        (HUGE, None),
        ("--3", None),
        ("٣", 3),
        ("²", None),
        ("", None),
        ("-", None),
    ],
)
def test_read_int(text, value):
    assert read_int(text) == value


def test_first_int_of_a_huge_number_is_none():
    assert first_int(f"I play {HUGE}") is None
    assert first_int("column 3") == 3


@pytest.mark.parametrize("protocol, action", [("text", f"answer({HUGE})"), ("tools", HUGE)])
def test_calculator_answer_with_a_huge_number_is_invalid(protocol, action):
    env = CalculatorEnv(protocol=protocol)
    env.reset(0)
    result = env.step(action)
    assert (
        result.done
        and result.reward == env.invalid_reward
        and result.info["invalid_action"] is True
    )


def test_calculator_answer_with_leading_zeros_is_read():
    env = CalculatorEnv(protocol="text")
    env.reset(0)
    assert env.step(f"answer({'0' * 5_000}{env.answer})").info["correct"] is True


def test_inventory_answer_with_a_huge_number_is_invalid():
    env = InventoryEnv()
    env.reset(0)
    result = env.step(HUGE)
    assert result.done and result.info["invalid_action"] is True


def test_game_move_with_a_huge_number_is_invalid():
    env = OpenSpielEnv()
    env.reset(0)
    result = env.step(f"I play column {HUGE}")
    assert (
        result.done
        and result.reward == env.invalid_reward
        and result.info["invalid_action"] is True
    )

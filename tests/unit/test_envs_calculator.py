"""The calculator tool-use env: questions, tool calls, answers, the tool cap, and the safe
evaluator (which must never run code or hang)."""

from __future__ import annotations

import re
import time
from fractions import Fraction

import pytest

from earl_lightning.envs import CalcError, CalculatorEnv, make_env, safe_eval
from earl_lightning.envs.calculator import format_number, make_question


def TextCalc(**kwargs) -> CalculatorEnv:
    """The first version's text protocol (calc(...) / answer(N)), what most of this file tests."""
    return CalculatorEnv(protocol="text", **kwargs)


def question_of(observation: str) -> str:
    return observation.removeprefix("What is ").split("?")[0]


def test_question_is_deterministic_and_answer_is_its_value():
    env = TextCalc(difficulty="medium")
    obs = env.reset(7)
    assert obs == TextCalc(difficulty="medium").reset(7)
    assert obs.endswith("? Use calc(expr) for a calculator, then answer with answer(N).")
    expr = question_of(obs)
    # Python's own arithmetic, on the literal question text, is the independent reference.
    assert env.answer == eval(expr, {"__builtins__": {}})  # noqa: S307 - trusted test input
    assert len({question_of(TextCalc().reset(s)) for s in range(20)}) > 15


@pytest.mark.parametrize(
    "difficulty, count, largest", [("easy", 2, 20), ("medium", 3, 99), ("hard", 4, 999)]
)
def test_difficulty_sets_the_size_of_the_question(difficulty, count, largest):
    for seed in range(10):
        expr, answer = make_question(seed, difficulty)
        numbers = [int(n) for n in re.findall(r"\d+", expr)]
        assert len(numbers) == count and max(numbers) <= largest
        assert answer == eval(expr, {"__builtins__": {}})  # noqa: S307


def test_correct_answer_after_tool_calls():
    env = TextCalc(difficulty="hard")
    expr = question_of(env.reset(3))
    res = env.step(f"Let me compute. calc({expr})")
    assert res == type(res)(
        f"calc: {env.answer}", 0.0, False, {"invalid_action": False, "tool_calls": 1}
    )
    res = env.step("calc(1/4)")
    assert res.observation == "calc: 0.25" and res.info["tool_calls"] == 2 and not res.done
    res = env.step(f"The result is answer({env.answer})")
    assert res.done and res.reward == 1.0
    assert res.info == {"invalid_action": False, "tool_calls": 2, "correct": True}


def test_wrong_answer_and_custom_rewards():
    env = TextCalc(correct_reward=2.0, wrong_reward=-0.5)
    env.reset(0)
    res = env.step(f"answer({env.answer + 1})")
    assert res.done and res.reward == -0.5
    assert res.info == {"invalid_action": False, "tool_calls": 0, "correct": False}
    assert res.observation == f"Wrong, the answer is {env.answer}."
    env.reset(0)
    assert env.step(f"answer( {env.answer} )").reward == 2.0


def test_tool_cap_ends_with_wrong_reward():
    env = TextCalc(max_tool_calls=2)
    env.reset(1)
    for i in (1, 2):
        res = env.step("calc(2+2)")
        assert not res.done and res.info["tool_calls"] == i
    res = env.step("calc(2+2)")
    assert res.done and res.reward == 0.0
    assert res.info == {
        "invalid_action": False,
        "tool_calls": 3,
        "truncated_tools": True,
        "correct": False,
    }


def test_calc_error_costs_a_call_but_is_not_invalid():
    env = TextCalc(max_tool_calls=1)
    env.reset(2)
    res = env.step("calc(1/0)")
    assert res.observation == "calc error: division by zero"
    assert not res.done and res.info == {"invalid_action": False, "tool_calls": 1}
    assert env.step("calc(1+1)").info["truncated_tools"]


@pytest.mark.parametrize(
    "text", ["the answer is 42", "", "answer(forty)", "answer(4.5)", "calculate 3+4"]
)
def test_text_without_a_call_or_integer_answer_is_invalid(text):
    env = TextCalc()
    env.reset(0)
    res = env.step(text)
    assert res.done and res.reward == -1.0 and res.info["invalid_action"]
    assert res.observation == "Invalid: use calc(expr) or answer(N)."


def test_first_call_in_the_text_wins_and_nested_parentheses_are_kept():
    env = TextCalc()
    env.reset(0)
    res = env.step("calc((2+3)*(4-1)) then answer(0)")
    assert res.observation == "calc: 15" and not res.done


@pytest.mark.parametrize(
    "expr, value",
    [
        ("37*12+5", 449),
        ("2**10", 1024),
        ("-(3-10)", 7),
        ("17//5", 3),
        ("17%5", 2),
        ("7/2", Fraction(7, 2)),
        ("2**-2", Fraction(1, 4)),
        (" ( 1 + 2 ) * 3 ", 9),
    ],
)
def test_safe_eval_arithmetic(expr, value):
    got = safe_eval(expr)
    # floor division too (int // on Fractions is an int)
    assert got == value and isinstance(got, Fraction)


@pytest.mark.parametrize(
    "expr, match",
    [
        ("__import__('os')", r"unsupported syntax Call"),
        ("__import__('os').system('true')", r"unsupported syntax Call"),
        ("x+1", r"unsupported syntax Name"),
        ("(1).__class__", r"unsupported syntax Attribute"),
        ("'a'*3", r"only integers are allowed, got 'a'"),
        ("1.5+1", r"only integers are allowed, got 1.5"),
        ("True+1", r"only integers are allowed, got True"),
        ("2**100000000", r"exponent must be an integer of size at most 16, got 100000000"),
        ("9**9**9", r"exponent must be an integer of size at most 16, got 387420489"),
        ("2**(1/2)", r"exponent must be an integer"),
        ("(10**16)**16*(10**16)**16", r"number too large"),
        ("10**9*10**9*10", r"number too large"),
        ("1 < 2", r"unsupported syntax Compare"),
        ("1 +", r"not an arithmetic expression"),
        ("1" * 201, r"longer than 200 characters"),
        ("0**-1", r"division by zero"),
    ],
)
def test_safe_eval_rejects(expr, match):
    start = time.perf_counter()
    with pytest.raises(CalcError, match=match):
        safe_eval(expr)
    assert time.perf_counter() - start < 0.5  # rejected fast, never computed


def test_unsafe_expression_through_the_env_is_a_calc_error():
    env = TextCalc()
    env.reset(0)
    res = env.step("calc(__import__('os').system('echo pwned'))")
    assert res.observation.startswith("calc error: unsupported syntax") and not res.done


def test_format_number():
    assert format_number(Fraction(12)) == "12" and format_number(Fraction(-3)) == "-3"
    assert format_number(Fraction(1, 3)) == "0.3333333333"


def test_step_after_done_raises():
    env = TextCalc()
    env.reset(0)
    env.step("answer(1)")
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("answer(1)")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"difficulty": "insane"},
            r"`difficulty` must be one of \['easy', 'medium', 'hard'\], got 'insane'",
        ),
        ({"max_tool_calls": -1}, r"`max_tool_calls` must be an integer >= 0, got -1"),
        ({"correct_reward": "1"}, r"`correct_reward` must be a finite number, got '1'"),
        ({"wrong_reward": float("inf")}, r"`wrong_reward` must be a finite number, got inf"),
        ({"invalid_reward": None}, r"`invalid_reward` must be a finite number, got None"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CalculatorEnv(**kwargs)


def test_registry_and_bad_names():
    assert make_env("calculator", difficulty="hard").reset(5) == CalculatorEnv(
        difficulty="hard"
    ).reset(5)
    with pytest.raises(
        ValueError, match=r"unknown argument\(s\) \['max_calls'\] for env 'calculator'"
    ):
        make_env("calculator", max_calls=2)
    with pytest.raises(
        ValueError, match=r"unknown `env` 'calculater'; valid environments: .*'calculator'"
    ):
        make_env("calculater")
    with pytest.raises(ValueError, match=r"`seed` must be an integer >= 0, got '3'"):
        TextCalc().reset("3")


# ---- property tests: the evaluator agrees with Python's integer arithmetic, and never raises
# anything but CalcError on arbitrary text ---------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_leaf = st.integers(min_value=0, max_value=10**6).map(str)
_expr = st.recursive(
    _leaf,
    lambda sub: st.one_of(
        st.tuples(sub, st.sampled_from(["+", "-", "*", "//", "%"]), sub).map(
            lambda t: f"({t[0]}{t[1]}{t[2]})"
        ),
        st.tuples(sub, st.integers(min_value=0, max_value=4)).map(lambda t: f"({t[0]})**{t[1]}"),
        sub.map(lambda s: f"-{s}"),
    ),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(_expr)
def test_safe_eval_matches_python_integer_arithmetic(expr):
    if len(expr) > 200:
        return
    try:
        expected = eval(expr, {"__builtins__": {}})  # noqa: S307 - generated from the grammar above
    except ZeroDivisionError:
        with pytest.raises(CalcError, match="division by zero"):
            safe_eval(expr)
        return
    try:
        got = safe_eval(expr)
    except CalcError as err:
        # Only the size bound may refuse a well-formed expression of this grammar.
        assert str(err) == "number too large"
        return
    assert got == expected and abs(expected) <= 10**18


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/%() .xa_'", max_size=60))
def test_safe_eval_never_raises_anything_else(text):
    try:
        value = safe_eval(text)
    except CalcError:
        return
    assert isinstance(value, Fraction)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=80))
def test_env_step_never_raises_on_any_text(text):
    env = TextCalc()
    env.reset(0)
    res = env.step(text)
    assert isinstance(res.observation, str) and isinstance(res.done, bool)


def test_the_calculator_is_a_tool_and_the_answer_a_message():
    env = CalculatorEnv(max_tool_calls=2)
    obs = env.reset(3)
    assert obs == f"What is {env.question}? Answer with the number."
    (tool,) = env.tools()
    assert tool == env.calculate and env.calculate(env.question) == str(env.answer)
    assert (
        env.calculate("2**100") == "Error: exponent must be an integer of size at most 16, got 100"
    )
    assert env.calculate("1+1") == "Error: no calculator calls left (at most 2)"
    result = env.step(str(env.answer))
    assert (
        result.done
        and result.reward == 1.0
        and result.info["correct"]
        and result.info["tool_calls"] == 3
    )
    assert result.info["truncated_tools"]
    env.reset(4)
    wrong = env.step(str(env.answer + 1))
    assert wrong.reward == 0.0 and not wrong.info["correct"] and not wrong.info["truncated_tools"]
    env.reset(5)
    bad = env.step("calc(1+1)")
    assert bad.info["invalid_action"] and bad.reward == -1.0
    assert TextCalc().tools() == []

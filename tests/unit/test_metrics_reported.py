"""Optional rates appear only for environments that report what they count: win/draw/loss for
games (an outcome), accuracy and tool use for the calculator (info["correct"],
info["tool_calls"]), the right tool's share for the inventory task (info["right_tool"])."""

from __future__ import annotations

import pytest

from earl_lightning.envs.policies import ImperfectCalculator, RandomLegal
from earl_lightning.models import load_tokenizer
from earl_lightning.modules.metrics import RunMetrics, reported
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.demonstrations import play_demonstrations
from earl_lightning.rollout.loop import ToolUse
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.tasks.tool_parsers import hermes


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("earl-tiny")


def _play(tok, env: str, policy: str, n: int, **policy_kwargs):
    specs = [EpisodeSpec(env, seed=s, group_id=s, episode_id=s) for s in range(n)]
    return play_demonstrations(
        specs,
        policy,
        policy_kwargs,
        tok,
        SamplingConfig(max_new_tokens=96),
        max_turns=4 if env == "calculator" else 30,
        max_context_tokens=4096,
        tools=ToolUse(hermes),
    )


def _evaluated(episodes) -> dict[str, float]:
    """The evaluation metrics of ``episodes``, with the rates they report."""
    run = RunMetrics()
    run.update_val(episodes, True)
    return run.compute_val(reported(episodes))


def test_calculator_episodes_report_accuracy_and_tool_use(tok):
    episodes = _play(tok, "calculator", "imperfect_calculator", 40, no_tool_share=0.25)
    assert reported(episodes) == {
        "outcomes": False,
        "graded": True,
        "tool_env": True,
        "tool_choice": False,
    }
    values = _evaluated(episodes)
    used = sum(ep.info["tool_calls"] > 0 for ep in episodes) / 40
    right = sum(ep.info["correct"] for ep in episodes) / 40
    assert values["val/tool_use_rate"] == pytest.approx(used) and values[
        "val/accuracy"
    ] == pytest.approx(right)
    # the imperfect user is right exactly when it used the tool
    assert used == right and 0.6 < used < 0.9
    assert "val/win_rate" not in values and "val/right_tool_rate" not in values


def test_inventory_episodes_report_how_often_the_first_call_is_the_right_tool(tok):
    episodes = _play(tok, "inventory", "imperfect_inventory", 40, wrong_tool_share=0.5)
    assert reported(episodes) == {
        "outcomes": False,
        "graded": True,
        "tool_env": True,
        "tool_choice": True,
    }
    values = _evaluated(episodes)
    right = sum(ep.info["right_tool"] is True for ep in episodes) / 40
    assert values["val/right_tool_rate"] == pytest.approx(right) and 0.25 < right < 0.75
    # the right tool gives the answer (a wrong one may give the same number by chance)
    assert all(ep.info["correct"] for ep in episodes if ep.info["right_tool"])
    assert right <= values["val/accuracy"] <= right + 0.1


def test_game_episodes_report_outcomes_only(tok):
    episodes = _play(tok, "connect_four", "random_legal", 6)
    assert reported(episodes) == {
        "outcomes": True,
        "graded": False,
        "tool_env": False,
        "tool_choice": False,
    }
    values = _evaluated(episodes)
    assert {"val/win_rate", "val/invalid_rate"} <= set(values)
    assert "val/accuracy" not in values and "val/tool_use_rate" not in values


def test_policies_are_independent_of_each_other():
    assert RandomLegal(3)("Legal: 0 1 2") == RandomLegal(3)("Legal: 0 1 2")
    assert (
        ImperfectCalculator(0, no_tool_share=0.0, protocol="text")("What is 2+3? Use calc(expr)")
        == "calc(2+3)"
    )
    assert ImperfectCalculator(0, protocol="text")("calc: 5") == "answer(5)"
    assert (
        ImperfectCalculator(0, no_tool_share=0.0)("What is 2+3? Answer with the number.")
        == '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    )
    assert ImperfectCalculator(0)("5") == "5"

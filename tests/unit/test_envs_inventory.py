"""The inventory tool task: a table drawn per seed, three look-up tools of which only the asked one
answers the question, the answer graded as a bare number, and its imperfect demonstration policy."""

from __future__ import annotations

import pytest

from earl_lightning.envs import InventoryEnv, make_env
from earl_lightning.envs.policies import make_policy
from earl_lightning.tasks.tool_parsers import hermes
from earl_lightning.tasks.tools import resolve_tools


def test_the_table_and_question_are_drawn_from_the_seed():
    env = InventoryEnv()
    obs = env.reset(11)
    assert obs == InventoryEnv().reset(11) and obs.endswith(" Answer with the number.")
    assert len(env.table) == 8 and env.item in obs
    assert env.answer == env.table[env.item][env.asked]
    assert len({InventoryEnv().reset(s) for s in range(30)}) > 20


def test_only_the_asked_tool_answers_and_the_answer_is_graded():
    env = InventoryEnv(max_tool_calls=4)
    env.reset(3)
    tools = {t.name: t for t in resolve_tools(env.tools())}
    assert sorted(tools) == ["price", "stock", "weight"]
    assert tools["price"].schema["function"]["parameters"]["required"] == ["item"]
    right = getattr(env, env.asked)(env.item)
    assert right == str(env.answer)
    assert env.price("durian").startswith("Error: no item 'durian'; the items are [")
    result = env.step(right)
    assert result.reward == 1.0 and result.info["correct"] and result.info["right_tool"] is True
    env.reset(3)
    other = next(f for f in ("price", "stock", "weight") if f != env.asked)
    getattr(env, other)(env.item)
    assert env.step("7").info["right_tool"] is False
    env.reset(3)
    bad = env.step("the answer")
    assert bad.info["invalid_action"] and bad.reward == -1.0 and bad.info["right_tool"] is None
    env.reset(4)
    for _ in range(4):
        env.stock(env.item)
    assert env.stock(env.item) == "Error: no tool calls left (at most 4)"


def test_the_imperfect_user_is_right_exactly_when_it_picks_the_right_tool():
    env, right_tool, correct = make_env("inventory"), [], []
    for seed in range(300):
        policy, obs = (
            make_policy("imperfect_inventory", {"wrong_tool_share": 0.4}, seed),
            env.reset(seed),
        )
        (call,) = hermes(policy(obs)).calls
        result = env.step(policy(getattr(env, call.name)(**call.arguments)))
        right_tool.append(result.info["right_tool"])
        correct.append(result.info["correct"])
    # the right tool always gives the answer
    assert all(c for c, r in zip(correct, right_tool) if r)
    assert 0.5 < sum(right_tool) / 300 < 0.7


@pytest.mark.parametrize("confusion, wrong_tools", [("neighbour", 3), ("either", 6)])
def test_the_imperfect_users_confusion(confusion, wrong_tools):
    """``neighbour``: a wrong call is always the asked field's neighbour (price -> stock ->
    weight -> price), so above a share of 0.5 the wrong tool is the most likely one; ``either``:
    both other tools."""
    env, picks = make_env("inventory"), set()
    neighbour = {"price": "stock", "stock": "weight", "weight": "price"}
    for seed in range(300):
        policy = make_policy(
            "imperfect_inventory", {"wrong_tool_share": 0.7, "confusion": confusion}, seed
        )
        obs = env.reset(seed)
        (call,) = hermes(policy(obs)).calls
        if call.name != env.asked:
            picks.add((env.asked, call.name))
            if confusion == "neighbour":
                assert call.name == neighbour[env.asked]
    assert len(picks) == wrong_tools


def test_a_bad_confusion_is_one_line():
    with pytest.raises(
        ValueError, match=r"`confusion` must be one of \['neighbour', 'either'\], got 'any'"
    ):
        make_policy("imperfect_inventory", {"confusion": "any"}, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_items": 0}, r"`num_items` must be in \[1, 16\], got 0"),
        ({"num_items": 17}, r"`num_items` must be in \[1, 16\], got 17"),
        ({"size": 3}, r"unknown argument\(s\) \['size'\] for env 'inventory'"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_env("inventory", **kwargs)

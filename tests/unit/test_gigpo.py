"""GiGPO (``advantage.name: gigpo``): GRPO's episode advantage plus a step-level advantage over the
turns a group took in the same state (anchor states), by the turns' discounted returns."""

from __future__ import annotations

import math

import pytest
import torch

from earl_lightning.algorithms import anchor_state_advantages, get_advantage_estimator
from earl_lightning.algorithms.estimators import AdvantageInputs
from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.modules.config import AlgorithmConfig, RolloutConfig, check_combination
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.train.advantages import check_whole_groups, estimate_advantages, state_keys


def test_anchor_states_by_hand():
    returns = torch.tensor([1.0, -2.0, 0.5, 0.5, 3.0, 7.0])
    keys = torch.tensor([7, 7, 9, 9, 11, 7])
    valid = torch.tensor([True, True, True, True, True, False])
    adv = anchor_state_advantages(returns, keys, valid)
    std = math.sqrt(4.5)  # unbiased std of [1, -2]
    # equal returns, a lone state, invalid
    expected = torch.tensor([1.5 / std, -1.5 / std, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        anchor_state_advantages(returns, keys, valid, scale="none"),
        torch.tensor([1.5, -1.5, 0.0, 0.0, 0.0, 0.0]),
    )
    assert torch.all(anchor_state_advantages(returns, keys, torch.zeros(6, dtype=torch.bool)) == 0)


def test_anchor_state_arguments_are_checked():
    with pytest.raises(ValueError, match="`state_keys` has shape"):
        anchor_state_advantages(
            torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.ones(3, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="scale"):
        anchor_state_advantages(
            torch.zeros(2),
            torch.zeros(2, dtype=torch.long),
            torch.ones(2, dtype=torch.bool),
            scale="rank",
        )


def _episode(
    group: int, eid: int, states: list[int], actions: list[int], rewards: list[float]
) -> Episode:
    """A windowed episode: turn t's prompt is [1, states[t]], its action the one token actions[t]."""
    ids, mask, starts = [1], [0], []
    for s, a in zip(states, actions):
        ids += [s]
        mask += [0]
        starts.append(len(ids))
        ids.append(a)
        mask.append(1)
    return Episode(
        spec=EpisodeSpec("x", 0, group, eid),
        token_ids=ids,
        action_mask=mask,
        logprobs=[-0.5 * m for m in mask],
        reward=sum(rewards),
        num_turns=len(states),
        done=True,
        truncated=False,
        invalid_action=False,
        outcome=None,
        error=None,
        turn_starts=starts,
        messages=[],
        turn_rewards=rewards,
        turn_prompts=[[1, s] for s in states],
    )


def _group() -> list[Episode]:
    """Group 0: both episodes start in state 20 and play 30 there; in state 21 one plays 31 and wins
    (+1), the other plays 32, an illegal move (-2). Group 1 visits state 20 too (another group)."""
    return [
        _episode(0, 0, [20, 21], [30, 31], [0.0, 1.0]),
        _episode(0, 1, [20, 21], [30, 32], [0.0, -2.0]),
        _episode(1, 2, [20, 22], [30, 33], [0.0, 1.0]),
        _episode(1, 3, [20, 22], [30, 33], [0.0, 1.0]),
    ]


def test_state_keys_are_equal_exactly_for_the_same_prompt_in_the_same_group():
    exp = episodes_to_experience(_group(), gamma=0.9)
    # rows: ep0 t0, ep0 t1, ep1 t0, ep1 t1, ep2 t0, ep2 t1, ep3 t0, ep3 t1
    keys = state_keys(exp).tolist()
    assert keys[0] == keys[2] and keys[1] == keys[3]  # group 0 in states 20 and 21
    assert keys[4] == keys[6] and keys[5] == keys[7]  # group 1 in states 20 and 22
    assert keys[0] != keys[4]  # state 20, but another group
    assert len({keys[0], keys[1], keys[4], keys[5]}) == 4


def test_gigpo_blames_the_turn_that_differed_and_not_the_turn_both_took():
    exp = episodes_to_experience(_group(), gamma=0.9)
    gigpo = estimate_advantages(exp, get_advantage_estimator("gigpo"), {}, num_groups=2)
    grpo = estimate_advantages(exp, get_advantage_estimator("grpo"), {}, num_groups=2)
    adv = [float(a) for a in gigpo.tokens["advantages"][exp.tokens["action_mask"] > 0]]
    base = [float(a) for a in grpo.tokens["advantages"][exp.tokens["action_mask"] > 0]]
    std = math.sqrt(4.5)  # returns in state 21: +1 and -2
    step = [
        0.0,
        1.5 / std,
        0.0,
        -1.5 / std,
        0.0,
        0.0,
        0.0,
        0.0,
    ]  # state 20: returns 0.9, -1.8 -> also split
    step[0], step[2] = 1.35 / math.sqrt(2 * 1.35**2), -1.35 / math.sqrt(2 * 1.35**2)
    assert adv == pytest.approx([b + s for b, s in zip(base, step)], rel=1e-5, abs=1e-6)
    # the turns that differed, set further apart than by GRPO
    assert adv[1] - adv[3] > base[1] - base[3] > 0
    assert adv[4:] == [0.0] * 4  # group 1 has no spread at all


def test_without_shared_states_gigpo_is_grpo():
    eps = [
        _episode(0, i, [20 + 2 * i, 21 + 2 * i], [30, 31], [0.0, r])
        for i, r in enumerate([1.0, -1.0, 0.5])
    ]
    exp = episodes_to_experience(eps, gamma=0.9)
    gigpo = estimate_advantages(exp, get_advantage_estimator("gigpo"), {}, num_groups=1).tokens[
        "advantages"
    ]
    grpo = estimate_advantages(exp, get_advantage_estimator("grpo"), {}, num_groups=1).tokens[
        "advantages"
    ]
    torch.testing.assert_close(gigpo, grpo)


def test_gigpo_needs_turn_rows_at_config_time_and_state_keys_at_run_time():
    algo = AlgorithmConfig(advantage={"name": "gigpo"})
    with pytest.raises(
        ValueError,
        match=r"`--model.algorithm.advantage.name` 'gigpo' compares turns .* "
        r"`--model.rollout.history_turns` \(e.g. 0\)",
    ):
        check_combination(RolloutConfig(), algo)
    check_combination(RolloutConfig(history_turns=0), algo)
    # the turn rows are discounted with its default
    assert algo.advantage.effective("gamma", 1.0) == 0.95
    inputs = AdvantageInputs(
        rewards=torch.zeros(2),
        group_ids=torch.zeros(2, dtype=torch.long),
        num_groups=1,
        episode_rows=torch.ones(2, dtype=torch.bool),
        token_rewards=torch.zeros(2, 1),
        mask=torch.ones(2, 1),
    )
    with pytest.raises(ValueError, match="needs one row per turn"):
        get_advantage_estimator("gigpo")(inputs)


def test_gigpo_on_several_processes_needs_whole_groups():
    est = get_advantage_estimator("gigpo")
    with pytest.raises(
        ValueError, match=r"set `--data.dispatch.keep_groups true` \(this run has 2 processes\)"
    ):
        check_whole_groups("gigpo", est, 2, False)
    check_whole_groups("gigpo", est, 2, True)
    check_whole_groups("gigpo", est, 1, False)
    check_whole_groups("grpo", get_advantage_estimator("grpo"), 2, False)


def test_step_weight_and_unknown_parameters():
    algo = AlgorithmConfig(advantage={"name": "gigpo", "kwargs": {"step_weight": 0.5}})
    assert algo.advantage.params == {"step_weight": 0.5}
    with pytest.raises(ValueError, match="step_weigth"):
        AlgorithmConfig(advantage={"name": "gigpo", "kwargs": {"step_weigth": 0.5}})

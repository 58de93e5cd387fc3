"""reward/zero_std_groups: the share of groups whose rewards have no spread (GRPO advantage 0)."""

from dataclasses import replace

import pytest
import torch

from earl_lightning.algorithms import get_advantage_estimator
from earl_lightning.algorithms.estimators import AdvantageInputs
from earl_lightning.modules.metrics import zero_spread_share
from earl_lightning.rollout.types import Episode, EpisodeSpec


def episode(group: int, reward: float) -> Episode:
    return Episode(
        spec=EpisodeSpec("x", 0, group, 0),
        token_ids=[1, 2],
        action_mask=[0, 1],
        logprobs=[0.0, -1.0],
        reward=reward,
        num_turns=1,
        done=True,
        truncated=False,
        invalid_action=False,
        outcome=None,
        error=None,
        turn_starts=[1],
        messages=[],
    )


def local(parts):
    return parts


@pytest.mark.parametrize(
    "rewards,groups,expected",
    [
        ([1.0, 1.0, 1.0, 0.0], [0, 0, 1, 1], 0.5),
        ([-2.0, -2.0, -2.0, -2.0], [0, 0, 1, 1], 1.0),
        ([0.1, 0.2, 0.3, 0.3], [0, 0, 1, 1], 0.5),
        ([1.0, 0.0, 1.0], [0, 0, 1], 0.0),  # a group of one is not counted either way
        ([1.0, 1.0, 5.0], [0, 0, 2], 1.0),  # group 1 empty (its members failed) is not counted
    ],
)
def test_share_of_groups_without_spread(rewards, groups, expected):
    eps = [episode(g, r) for g, r in zip(groups, rewards)]
    assert zero_spread_share(eps, max(groups) + 1, local) == expected


def test_a_flat_group_is_exactly_one_whose_grpo_advantages_are_zero():
    rewards = [0.7, 0.7, 0.7, 0.7, 1.0, -2.0, 1.0, 1.0]
    ids = [0, 0, 0, 0, 1, 1, 1, 1]
    mask = torch.ones(8, 1)
    out = get_advantage_estimator("grpo")(
        AdvantageInputs(
            rewards=torch.tensor(rewards),
            group_ids=torch.tensor(ids),
            num_groups=2,
            episode_rows=torch.ones(8, dtype=bool),
            token_rewards=torch.zeros(8, 1),
            mask=mask,
        )
    )
    adv = out.advantages[:, 0]
    assert torch.all(adv[:4] == 0) and torch.all(adv[4:] != 0)
    assert zero_spread_share([episode(g, r) for g, r in zip(ids, rewards)], 2, local) == 0.5


def test_no_groups_of_two_gives_zero():
    assert zero_spread_share([], 3, local) == 0.0
    assert zero_spread_share([replace(episode(0, 1.0))], 1, local) == 0.0

"""An agent's episode split into rows (``Episode.row_starts``) packs as one row per part: each part
its own sequence with the episode's reward, its tokens and masks exact, and for token-level
estimators each part's last generated token carrying the episode's return from there."""

from __future__ import annotations

import pytest

from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.rollout.types import Episode, EpisodeSpec


def agent_episode(error=None) -> Episode:
    # row 0: prompt 0 1, generated 10 11, closing 2, tool 3, generated 12; row 1: prompt 4 5, generated 13 14
    ids = [0, 1, 10, 11, 2, 3, 12, 2, 4, 5, 13, 14, 2]
    mask = [0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0]
    lps = [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5, 0.0]
    return Episode(
        spec=EpisodeSpec(None, seed=0, group_id=0, episode_id=0, row={"prompt": "p"}),
        token_ids=ids,
        action_mask=mask,
        logprobs=lps,
        reward=2.0,
        num_turns=3,
        done=True,
        truncated=False,
        invalid_action=False,
        outcome=None,
        error=error,
        turn_starts=[2, 6, 10],
        messages=[],
        row_starts=[8],
        from_agent=True,
        agent_reward=2.0,
    )


def test_an_agent_episode_becomes_one_row_per_part():
    batch = episodes_to_experience([agent_episode()], gamma=0.5)
    assert batch.cu_seqlens.tolist() == [0, 8, 13]
    assert batch.seqs["turn_index"].tolist() == [0, 1]
    assert batch.seqs["rewards"].tolist() == [2.0, 2.0]
    assert batch.tokens["input_ids"].tolist() == agent_episode().token_ids
    assert batch.tokens["action_mask"].tolist() == agent_episode().action_mask
    rewards = batch.tokens["token_rewards"].tolist()
    # the last row: the episode's reward on its last generated token
    assert rewards[11] == 2.0
    # the first row ends its own sequence: the return from its last generated token (2 generated
    # tokens of the next row after it, discounted by 0.5 each)
    assert rewards[6] == pytest.approx(2.0 * 0.5**2)
    assert sum(r != 0 for r in rewards) == 2


def test_a_failed_agent_episode_trains_on_nothing():
    batch = episodes_to_experience([agent_episode(error="the agent raised")], gamma=1.0)
    assert batch.tokens["action_mask"].sum() == 0 and batch.tokens["token_rewards"].abs().sum() == 0

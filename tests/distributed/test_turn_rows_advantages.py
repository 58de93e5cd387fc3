"""Turn rows (``history_turns``) on 2 processes: the rows of one episode split across ranks, the
module's advantage path (``estimate_advantages`` with all-reduced moments) equals one process; so
does GiGPO with each group's rows on one rank (``dispatch.keep_groups``), as it requires."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.algorithms.estimators import get_advantage_estimator
from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.train.advantages import estimate_advantages
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed


def episodes() -> list[Episode]:
    """12 hand-made episodes in 3 groups, 1-5 turns each, 1-2 generated tokens per turn."""
    g = torch.Generator().manual_seed(7)
    out = []
    for e in range(12):
        turns = 1 + e % 5
        ids, mask, prompts, starts, rewards = [1], [0], [], [], []
        for t in range(turns):
            n = 1 + (e + t) % 2
            prompts.append([2, 3 + t])
            starts.append(len(ids))
            ids += [5 + t] * n + [4]
            mask += [1] * n + [0]
            rewards.append(float(torch.randn(1, generator=g)))
        out.append(
            Episode(
                spec=EpisodeSpec("recall", 0, e // 4, e),
                token_ids=ids,
                action_mask=mask,
                logprobs=[-0.1 if m else 0.0 for m in mask],
                reward=sum(rewards),
                num_turns=turns,
                done=True,
                truncated=False,
                invalid_action=False,
                outcome=None,
                error=None,
                turn_starts=starts,
                messages=[],
                turn_rewards=rewards,
                turn_prompts=prompts,
            )
        )
    return out


PARAMS = {"grpo": dict(scale="group"), "reinforce_pp": dict(gamma=0.9), "gigpo": dict(gamma=0.9)}


def advantages(batch, name: str, **kw):
    return estimate_advantages(
        batch, get_advantage_estimator(name), PARAMS[name], num_groups=3, **kw
    )


def _worker(rank: int, world: int) -> dict[str, list[float]]:
    exp = episodes_to_experience(episodes(), gamma=0.9)
    # Alternate rows between the ranks: every multi-turn episode has rows on both.
    local = exp.select([i for i in range(exp.num_seqs) if i % world == rank])
    out = {}
    for est in ("grpo", "reinforce_pp"):
        res = advantages(local, est, reduce=Reducer().sum_moments)
        out[est] = res.tokens["advantages"].tolist()
    # keep_groups: group g on rank g % world
    whole_groups = exp.select(_group_rows(exp, rank, world))
    out["gigpo"] = (
        advantages(whole_groups, "gigpo", reduce=Reducer().sum_moments)
        .tokens["advantages"]
        .tolist()
    )
    return out


def _group_rows(exp, rank: int, world: int) -> list[int]:
    return [i for i, g in enumerate(exp.seqs["group_ids"].tolist()) if g % world == rank]


def test_turn_row_advantages_split_across_ranks_equal_one_process():
    exp = episodes_to_experience(episodes(), gamma=0.9)
    assert exp.num_seqs == sum(1 + e % 5 for e in range(12))
    results = run_distributed(_worker, 2)
    for est in ("grpo", "reinforce_pp"):
        single = advantages(exp, est).tokens["advantages"]
        for rank, res in enumerate(results):
            rows = [i for i in range(exp.num_seqs) if i % 2 == rank]
            expected = single[exp.token_positions(rows)]
            torch.testing.assert_close(
                torch.tensor(res[est]), expected, rtol=1e-6, atol=1e-6, msg=f"{est} {rank}"
            )


def test_gigpo_with_whole_groups_on_each_rank_equals_one_process():
    exp = episodes_to_experience(episodes(), gamma=0.9)
    single = advantages(exp, "gigpo").tokens["advantages"]
    # the groups share states
    assert not torch.equal(single, advantages(exp, "grpo").tokens["advantages"])
    for rank, res in enumerate(run_distributed(_worker, 2)):
        expected = single[exp.token_positions(_group_rows(exp, rank, 2))]
        torch.testing.assert_close(
            torch.tensor(res["gigpo"]), expected, rtol=1e-6, atol=1e-6, msg=f"gigpo {rank}"
        )

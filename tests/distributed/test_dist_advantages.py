"""Distributed GRPO and REINFORCE++ advantages equal the single-process ones (2 and 4 processes).

Rewards stay on their rank; only [3, G+1] float64 moments are all-reduced. GRPO groups are split
across ranks on purpose, one rank holds nothing, and a TP layout's replicas are not double counted.
"""

from __future__ import annotations

import pytest
import torch

from earl_lightning.algorithms.advantages import grpo_advantages, reinforce_pp_advantages
from earl_lightning.data.dist_advantages import dist_grpo_advantages, dist_num_groups, dist_reinforce_pp_advantages
from earl_lightning.parallel.layout import Layout
from tests.distributed.launch import run_distributed

NUM_SEQS, NUM_GROUPS, WIDTH = 37, 7, 23

pytestmark = pytest.mark.distributed


def global_data():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(NUM_SEQS, generator=g) * 3 + 1
    group_ids = torch.randint(0, NUM_GROUPS, (NUM_SEQS,), generator=g)
    token_rewards = torch.randn(NUM_SEQS, WIDTH, generator=g)
    mask = (torch.rand(NUM_SEQS, WIDTH, generator=g) > 0.4).long()
    return rewards, group_ids, token_rewards, mask


def shard(world: int, dp_rank: int, dp: int) -> torch.Tensor:
    """Uneven contiguous shards; the last dp rank gets nothing when there are several."""
    cuts = [0, 5, 20, NUM_SEQS, NUM_SEQS] if dp == 4 else [0, 11, NUM_SEQS]
    return torch.arange(cuts[dp_rank], cuts[dp_rank + 1])


def compare(rank: int, world: int, tp: int) -> int:
    layout = Layout(dp=world // tp, tp=tp)
    rewards, group_ids, token_rewards, mask = global_data()
    rows = shard(world, layout.coords(rank)[0], layout.dp)
    num_groups = dist_num_groups(group_ids[rows])
    assert num_groups == NUM_GROUPS
    for scale in ("group", "batch", "none"):
        local = dist_grpo_advantages(rewards[rows], group_ids[rows], num_groups=num_groups, scale=scale,
                                     layout=layout)
        single = grpo_advantages(rewards, group_ids, num_groups=NUM_GROUPS, scale=scale)[rows]
        torch.testing.assert_close(local, single, rtol=1e-6, atol=1e-6)
    for gamma in (1.0, 0.9):
        local = dist_reinforce_pp_advantages(token_rewards[rows], mask[rows], gamma=gamma, layout=layout)
        single = reinforce_pp_advantages(token_rewards, mask, gamma=gamma)[rows]
        torch.testing.assert_close(local, single, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"`scale` must be one of \['group', 'batch', 'none'\], got 'rank'"):
        dist_grpo_advantages(rewards[rows], group_ids[rows], num_groups=num_groups, scale="rank")
    with pytest.raises(ValueError, match=r"`layout` dp3xtp1 has dp\*tp = 3, but the world size is"):
        dist_grpo_advantages(rewards[rows], group_ids[rows], num_groups=num_groups, layout=Layout(3, 1))
    return int(rows.numel())


def compare_layouts(rank: int, world: int, tps: list[int]) -> list[int]:
    """Every TP degree in one process group: spawning gloo workers costs more than the checks."""
    return [compare(rank, world, tp) for tp in tps]


@pytest.mark.parametrize("world,tps", [(2, [1]), (4, [1, 2])])
def test_distributed_advantages_equal_single_process(world, tps):
    counts = run_distributed(compare_layouts, world, tps)
    for j, tp in enumerate(tps):
        assert sum(c[j] for c in counts[::tp]) == NUM_SEQS

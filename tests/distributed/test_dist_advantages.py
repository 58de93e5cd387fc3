"""Every registered advantage estimator on 2 and 4 processes equals one process.

Rewards stay on their rank; only float64 moments are all-reduced (``Reducer.sum_moments``). GRPO
groups are split across ranks on purpose, one rank holds nothing, and a TP layout's replicas are
not double counted.
"""

from __future__ import annotations

import pytest
import torch

from earl_lightning.algorithms.estimators import AdvantageInputs, get_advantage_estimator
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.layout import Layout
from tests.distributed.launch import run_distributed

NUM_SEQS, NUM_GROUPS, WIDTH = 37, 7, 23
CASES = [
    ("grpo", dict(scale="group")),
    ("grpo", dict(scale="batch")),
    ("grpo", dict(scale="none")),
    ("rloo", {}),
    ("reinforce_pp", dict(gamma=1.0)),
    ("reinforce_pp", dict(gamma=0.9)),
    ("gae", dict(gamma=0.9, lam=0.95)),
]

pytestmark = pytest.mark.distributed


def global_inputs() -> AdvantageInputs:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(NUM_SEQS, generator=g) * 3 + 1
    group_ids = torch.randint(0, NUM_GROUPS, (NUM_SEQS,), generator=g)
    mask = (torch.rand(NUM_SEQS, WIDTH, generator=g) > 0.4).float()
    return AdvantageInputs(
        rewards=rewards,
        group_ids=group_ids,
        num_groups=NUM_GROUPS,
        episode_rows=torch.ones(NUM_SEQS, dtype=torch.bool),
        token_rewards=torch.randn(NUM_SEQS, WIDTH, generator=g) * mask,
        mask=mask,
        values=torch.randn(NUM_SEQS, WIDTH, generator=g),
    )


def rows_of(inputs: AdvantageInputs, rows: torch.Tensor) -> AdvantageInputs:
    return AdvantageInputs(
        rewards=inputs.rewards[rows],
        group_ids=inputs.group_ids[rows],
        num_groups=NUM_GROUPS,
        episode_rows=inputs.episode_rows[rows],
        token_rewards=inputs.token_rewards[rows],
        mask=inputs.mask[rows],
        values=inputs.values[rows],
    )


def shard(dp_rank: int, dp: int) -> torch.Tensor:
    """Uneven contiguous shards; the last dp rank gets nothing when there are several."""
    cuts = [0, 5, 20, NUM_SEQS, NUM_SEQS] if dp == 4 else [0, 11, NUM_SEQS]
    return torch.arange(cuts[dp_rank], cuts[dp_rank + 1])


def compare(rank: int, world: int, tp: int) -> int:
    layout = Layout(dp=world // tp, tp=tp)
    reducer = Reducer(layout)
    full = global_inputs()
    rows = shard(layout.coords(rank)[0], layout.dp)
    for name, params in CASES:
        est = get_advantage_estimator(name)
        local = est(rows_of(full, rows), reducer.sum_moments, **params)
        single = est(full, **params)
        torch.testing.assert_close(
            local.advantages, single.advantages[rows], rtol=1e-6, atol=1e-6, msg=name
        )
    with pytest.raises(
        ValueError, match=r"`scale` must be one of \['group', 'batch', 'none'\], got 'rank'"
    ):
        get_advantage_estimator("grpo")(rows_of(full, rows), reducer.sum_moments, scale="rank")
    with pytest.raises(ValueError, match=r"`layout` dp3xtp1 has dp\*tp = 3, but the world size is"):
        Reducer(Layout(3, 1))
    return int(rows.numel())


def compare_layouts(rank: int, world: int, tps: list[int]) -> list[int]:
    """Every TP degree in one process group: spawning gloo workers costs more than the checks."""
    return [compare(rank, world, tp) for tp in tps]


@pytest.mark.parametrize("world,tps", [(2, [1]), (4, [1, 2])])
def test_distributed_advantages_equal_single_process(world, tps):
    counts = run_distributed(compare_layouts, world, tps)
    for j, tp in enumerate(tps):
        assert sum(c[j] for c in counts[::tp]) == NUM_SEQS

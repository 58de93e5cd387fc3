"""Dispatcher errors on 2 gloo processes: bad layouts, a NaN reward on one rank only (every rank
raises instead of hanging), mismatched fields, and an empty rank without fields (it adopts them)."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.dispatch.centralized import CentralizedDispatcher
from earl_lightning.dispatch.dispatcher import Dispatcher
from earl_lightning.parallel.layout import Layout
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed


def small_batch(rank: int, n: int = 3, reward_dtype=torch.float32) -> ExperienceBatch:
    return ExperienceBatch.from_sequences(
        {"input_ids": [torch.arange(k + 1) for k in range(n)]},
        {
            "rewards": torch.ones(n, dtype=reward_dtype),
            "group_ids": torch.zeros(n, dtype=torch.long),
            "episode_ids": torch.arange(n) + 100 * rank,
        },
    )


def check_errors(rank: int, world: int) -> str:
    d = Dispatcher()
    with pytest.raises(
        ValueError,
        match=r"`to` dp4xtp1 has dp\*tp = 4, but the world size is 2; "
        r"valid layouts: \['dp2xtp1', 'dp1xtp2'\]",
    ):
        d.exchange(small_batch(rank), Layout(dp=4, tp=1))
    with pytest.raises(ValueError, match=r"`src` dp1xtp1 has dp\*tp = 1, but the world size is 2"):
        d.exchange(small_batch(rank), Layout(dp=2, tp=1), src=Layout(dp=1, tp=1))
    with pytest.raises(ValueError, match=r"`to` must be a Layout\(dp=..., tp=...\), got 'dp2'"):
        d.exchange(small_batch(rank), "dp2")
    with pytest.raises(
        ValueError, match=r"`tp_mode` must be one of \['auto', 'direct', 'broadcast'\], got 'ring'"
    ):
        Dispatcher(tp_mode="ring")
    with pytest.raises(
        ValueError, match=r"`method` must be one of \['tensor', 'object'\], got 'pickle'"
    ):
        CentralizedDispatcher(method="pickle")

    # A NaN reward written into rank 1's batch after construction: rank 1 names the episode, rank 0
    # is told which rank failed; nobody hangs in the all-to-all.
    batch = small_batch(rank)
    if rank == 1:
        batch.seqs["rewards"][2] = float("nan")
    expected = (
        r"reward of episode 102 is nan" if rank == 1 else r"the batch of rank\(s\) \[1\] is invalid"
    )
    with pytest.raises(ValueError, match=expected):
        d.exchange(batch, Layout(dp=2, tp=1))
    # Mismatched field lengths, same treatment.
    batch = small_batch(rank)
    if rank == 0:
        batch.tokens["input_ids"] = batch.tokens["input_ids"][:-1]
    expected = (
        r"token field 'input_ids' has shape \(5,\), expected \(6,\)"
        if rank == 0
        else r"rank\(s\) \[0\]"
    )
    with pytest.raises(ValueError, match=expected):
        d.exchange(batch, Layout(dp=1, tp=2))
    # Ranks holding sequences with different fields.
    with pytest.raises(ValueError, match=r"ranks hold batches with different fields"):
        d.exchange(
            small_batch(rank, reward_dtype=torch.float64 if rank else torch.float32),
            Layout(dp=2, tp=1),
        )
    with pytest.raises(ValueError, match=r"`keep_groups=True` needs a `group_ids` sequence field"):
        b = small_batch(rank)
        del b.seqs["group_ids"]
        d.exchange(b, Layout(dp=2, tp=1), keep_groups=True)
    # The dispatcher still works after all those errors, and an empty rank built without fields
    # adopts the others' fields.
    batch = (
        small_batch(rank, n=4) if rank == 0 else ExperienceBatch(torch.zeros(1, dtype=torch.long))
    )
    out = d.exchange(batch, Layout(dp=2, tp=1))
    assert out.schema() == small_batch(0).schema()
    stats = d.last_stats
    assert {"bytes", "seconds", "imbalance", "total_bytes"} <= set(stats)
    assert stats["imbalance"] == 1.0 and stats["bytes"] > 0
    return sorted(out.seqs["episode_ids"].tolist())


def test_dispatcher_errors_are_clear_and_collective():
    results = run_distributed(check_errors, 2)
    assert sorted(results[0] + results[1]) == [0, 1, 2, 3]


def check_subgroup_broadcast_refused(rank: int, world: int) -> str:
    """A dispatcher over a group of 2 of the 4 processes cannot make TP broadcast groups (``new_group``
    is collective over every process): each pair's ranks get the same error before any data moves,
    nobody hangs."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    d = Dispatcher(pairs[rank // 2], tp_mode="broadcast")
    moved = []  # the refusal comes before the all-to-all: no rank sends its rows into a failed exchange
    all_to_all = d._all_to_all
    d._all_to_all = lambda *args: moved.append(args) or all_to_all(*args)
    with pytest.raises(ValueError) as err:
        d.exchange(small_batch(rank % 2), Layout(dp=1, tp=2))
    assert moved == []
    direct = Dispatcher(pairs[rank // 2], tp_mode="direct").exchange(
        small_batch(rank % 2), Layout(dp=1, tp=2)
    )
    assert sorted(direct.seqs["episode_ids"].tolist()) == [0, 1, 2, 100, 101, 102]
    return str(err.value)


def test_broadcast_over_a_group_that_does_not_span_the_world_is_refused():
    results = run_distributed(check_subgroup_broadcast_refused, 4)
    assert (
        results
        == [
            "Dispatcher(group=...): a TP broadcast needs the group to span every process (got 2 of 4); "
            "use tp_mode='direct' or the default group"
        ]
        * 4
    )

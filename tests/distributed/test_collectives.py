"""The Reducer and the run metrics on 2 and 4 gloo processes against one process.

Layouts dp2xtp1 and dp2xtp2 (4 ranks): ranks of one TP group hold identical rows, and every sum
must count them once; maxima and "any" are over all ranks; the torchmetrics run metrics log the
figures of the whole batch, equal to one process computing them over every episode."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.parallel.collectives import Reducer, global_rank
from earl_lightning.parallel.layout import Layout
from earl_lightning.rollout.types import Episode, EpisodeSpec
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed
OUTCOMES = ["win", "loss", None, "draw", "win", None, "loss", "win"]


def episodes(dp_rank: int, dp: int) -> list[Episode]:
    """Episode ``i`` of 8 lives on dp rank ``i % dp``; rewards, outcomes and lengths differ."""
    out = []
    for i in range(dp_rank, 8, dp):
        n = 3 + i
        out.append(
            Episode(
                spec=EpisodeSpec("x", i, i, i),
                token_ids=list(range(n)),
                action_mask=[0, 1] * (n // 2) + [0] * (n % 2),
                logprobs=[0.0] * n,
                reward=0.5 * i - 1,
                num_turns=1 + i % 3,
                done=True,
                truncated=i == 5,
                invalid_action=i == 2,
                outcome=OUTCOMES[i],
                error="boom" if i == 6 else None,
                turn_starts=[1],
                messages=[],
            )
        )
    return out


def grouped(dp_rank: int, dp: int) -> list[Episode]:
    """Episodes ``i`` of 8 in groups of two (``i // 2``), each group split over the dp ranks when
    dp = 2; groups 0 and 2 have equal rewards (no spread), groups 1 and 3 do not."""
    rewards = [1.0, 1.0, 0.0, 1.0, -2.0, -2.0, 0.3, 0.30001]
    return [
        replace(e, spec=EpisodeSpec("x", i, i // 2, i), reward=rewards[i])
        for e, i in zip(episodes(dp_rank, dp), range(dp_rank, 8, dp))
    ]


def experience(eps: list[Episode]) -> ExperienceBatch:
    return ExperienceBatch.from_sequences(
        {
            "input_ids": [torch.tensor(e.token_ids) for e in eps],
            "action_mask": [torch.tensor(e.action_mask, dtype=torch.float32) for e in eps],
        },
        {"rewards": torch.tensor([e.reward for e in eps])},
    )


def metrics_of(layout: Layout | None) -> tuple[dict[str, float], dict[str, float]]:
    from earl_lightning.modules.metrics import FLAGS, RunMetrics

    dp_rank, dp = (layout.coords(global_rank())[0], layout.dp) if layout else (0, 1)
    counted = Reducer(layout).counts_here
    eps = episodes(dp_rank, dp)
    run = RunMetrics()
    step = run.step(eps, counted, experience(eps), counted)
    run.update_val(eps, counted)
    return step, run.compute_val(dict.fromkeys(FLAGS, False) | {"outcomes": True})


def check(rank: int, world: int, tp: int) -> dict:
    layout = Layout(dp=world // tp, tp=tp)
    reducer = Reducer(layout)
    dp_rank = layout.coords(rank)[0]
    # sum: each TP group once; max / any / agree_count: over every rank
    assert reducer.sum(torch.tensor([float(dp_rank + 1)])).item() == sum(range(1, layout.dp + 1))
    assert reducer.sum_floats([1.0, 2.0]) == [layout.dp, 2.0 * layout.dp]
    assert reducer.max(torch.tensor([float(rank)])).item() == world - 1
    assert reducer.any(rank == world - 1) and not reducer.any(False)
    assert reducer.agree_count(rank) == world - 1
    grad = torch.nn.Parameter(torch.zeros(2))
    grad.grad = torch.full((2,), float(dp_rank + 1))
    reducer.sum_replicated_gradients([grad])
    assert grad.grad.tolist() == [float(sum(range(1, layout.dp + 1)))] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, val = metrics_of(layout)
    assert not [w for w in caught if "sync" in str(w.message).lower()], [
        str(w.message) for w in caught
    ]
    from earl_lightning.modules.metrics import zero_spread_share

    flat = zero_spread_share(grouped(dp_rank, layout.dp), 4, reducer.sum_moments)
    return {"step": step, "val": val, "world": dist.get_world_size(), "flat": flat}


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_reducer_and_run_metrics_equal_one_process(world, tp):
    results = run_distributed(check, world, tp)
    from earl_lightning.modules.metrics import zero_spread_share

    step, val = metrics_of(None)  # one process, all 8 episodes
    flat = zero_spread_share(grouped(0, 1), 4, lambda parts: parts)
    assert flat == 0.5  # groups 0 and 2 of 4
    assert (
        step["env/errors"] == 1.0 and step["env/win_rate"] == 3 / 8 and step["context/max"] == 10.0
    )
    for res in results:
        assert res["flat"] == flat
        assert res["step"].keys() == step.keys()
        for k, v in step.items():
            assert res["step"][k] == pytest.approx(v, rel=1e-6), k
        for k, v in val.items():
            assert res["val"][k] == pytest.approx(v, rel=1e-6), k

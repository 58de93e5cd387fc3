"""Layout-aware reshard vs the naive reference, and the train -> rollout -> train round trip."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from earl_lightning.models import make_tiny_model
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import build_replica, parallelize_model
from earl_lightning.parallel.reshard import (
    Resharder,
    local_tensor,
    reshard_naive,
    sharded_parameters,
)
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed


def _mesh(layout: Layout):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))


def _locals(model) -> list[torch.Tensor]:
    return [local_tensor(p).detach().clone() for _, p in sharded_parameters(model)]


def _train_model(path: str, layout: Layout):
    """A train-layout model whose weights moved away from the checkpoint (one SGD step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    parallelize_model(model, mesh=_mesh(layout), layout=layout)
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 9))
    model(ids).logits.float().pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model


def _worker(
    rank: int, world: int, path: str, train: tuple[int, int], targets: list[tuple[int, int]]
):
    train_layout = Layout(*train)
    model = _train_model(path, train_layout)
    before = _locals(model)
    out = []
    for dst in targets:
        layout = Layout(*dst)
        aware, naive = (
            build_replica(model, mesh=_mesh(layout), layout=layout, device="cpu") for _ in range(2)
        )
        resharder = Resharder(model, aware, bucket_mb=0.05)  # small buckets: several all-to-alls
        s_aware, s_naive = resharder.run(), reshard_naive(model, naive)
        equal = all(torch.equal(a, b) for a, b in zip(_locals(aware), _locals(naive)))
        # Round trip back into a fresh, empty train-layout copy (FSDP x TP), bit for bit.
        back = build_replica(
            model, mesh=_mesh(train_layout), layout=train_layout, device="cpu", fsdp=True
        )
        Resharder(aware, back).run()
        round_trip = all(torch.equal(a, b) for a, b in zip(_locals(back), before))
        # Same answer from the replica: the forward of the resharded model matches the train model.
        ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            diff = (aware(ids).logits - model(ids).logits).abs().max().item()
        colwise_moves = [
            t
            for t in resharder.plan.transfers
            if t.src != t.dst and "q_proj.weight" in resharder.names[t.param]
        ]
        out.append(
            dict(
                dst=dst,
                equal=equal,
                round_trip=round_trip,
                diff=diff,
                aware=s_aware.bytes_received,
                naive=s_naive.bytes_received,
                buckets=s_aware.num_buckets,
                colwise_moves=len(colwise_moves),
            )
        )
    dist.barrier()
    return out


def _check(results, zero_move_targets=()):
    for per_rank in results:
        for r in per_rank:
            assert r["equal"], r
            assert r["round_trip"], r
            assert r["diff"] < 1e-5, r
            assert r["aware"] <= r["naive"], r
            assert r["buckets"] > 1, r
            if r["dst"] in zero_move_targets:
                assert r["colwise_moves"] == 0, r
    total = lambda k: sum(r[k] for per_rank in results for r in per_rank)  # noqa: E731
    assert total("aware") < total("naive")


def test_reshard_2_processes():
    path = str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128))
    # FSDP Shard(0) over ranks {0, 1} and colwise TP Shard(0) over the same ranks: q_proj moves 0 bytes.
    _check(run_distributed(_worker, 2, path, (2, 1), [(1, 2), (2, 1)]), zero_move_targets=[(1, 2)])


def test_reshard_4_processes():
    path = str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128))
    _check(run_distributed(_worker, 4, path, (2, 2), [(2, 2), (4, 1)]))

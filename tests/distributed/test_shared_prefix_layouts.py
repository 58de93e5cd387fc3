"""The shared-prefix forward under the parallel layouts: FSDP2 over dp=2 (two forwards of every
sharded layer before one backward), TP=2 (the cache holds each rank's heads), and dp=2 with PPO's
value head. One PPO update with ``share_prefix`` on, on 2 processes, must end at the parameters of
the single-process update with the plain forward over the whole batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import parallelize_model
from earl_lightning.train.prefix import plan_shared_prefix
from earl_lightning.train.update import Models, UpdateConfig
from tests.distributed.launch import run_distributed
from tests.distributed.test_update_uneven import _params, update, value_head
from tests.unit.test_shared_prefix import _batch
from tests.updates import reference_update

pytestmark = pytest.mark.distributed

GROUPS = ((12, 4), (20, 4))  # (prompt length, group size): one group per data-parallel rank
CFG = reference_update(micro_batch_tokens=4096, max_grad_norm=0.0, value_coef=1.0, value_clip=None)
LAYOUTS = [(2, 1, False), (1, 2, False), (2, 1, True)]  # (dp, tp, with a value head)


def _with_values(batch):
    g = torch.Generator().manual_seed(11)
    extra = {
        k: 0.1 * torch.randn(batch.num_tokens, generator=g)
        for k in ("old_logprobs", "values", "returns")
    }
    return type(batch)(batch.cu_seqlens, {**batch.tokens, **extra}, batch.seqs)


def placed(path: str, full, dp: int, tp: int):
    """(the model parallelized for dp x tp, its layout, this rank's share of ``full``'s rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    layout = Layout(dp=dp, tp=tp)
    parallelize_model(
        model, mesh=init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")), layout=layout
    )
    dp_rank, _ = layout.coords(dist.get_rank())  # the ranks of one TP group hold the same rows
    per = full.num_seqs // dp
    return model, layout, full.select(list(range(dp_rank * per, (dp_rank + 1) * per)))


def _worker(rank: int, world: int, path: str):
    out = {}
    full = _with_values(_batch(GROUPS))
    for dp, tp, with_value in LAYOUTS:
        model, layout, mine = placed(path, full, dp, tp)
        assert plan_shared_prefix(mine) is not None  # the shared path is what runs here
        models = Models(model, value_head() if with_value else None)
        cfg = replace(CFG, share_prefix=True)
        stats = update(models, mine, cfg, Reducer(layout))
        params = _params(models)  # a collective: every rank gathers
        out[(dp, tp, with_value)] = (
            ({n: p.numpy() for n, p in params.items()}, stats["loss/policy"]) if rank == 0 else None
        )
    return out


def assert_layouts_match_one_process(got: dict, path: str, batch, cfg: UpdateConfig) -> None:
    """Every (dp, tp, with a value head) entry of ``got`` (rank 0's parameters and policy loss)
    equals one process's update of the whole ``batch`` under ``cfg`` (the plain forward)."""
    from transformers import AutoModelForCausalLM

    for (dp, tp, with_value), (params, loss, *_) in got.items():
        ref = Models(
            AutoModelForCausalLM.from_pretrained(path), value_head() if with_value else None
        )
        before = _params(ref)
        stats = update(ref, batch, cfg, Reducer())
        expected = _params(ref)
        assert loss == pytest.approx(stats["loss/policy"], rel=1e-4, abs=1e-7)
        assert sum((expected[n] - before[n]).abs().sum().item() for n in before) > 0
        for name, value in expected.items():
            torch.testing.assert_close(
                torch.from_numpy(params[name]),
                value,
                rtol=1e-4,
                atol=1e-6,
                msg=f"{name} dp={dp} tp={tp} value={with_value}",
            )


def test_shared_prefix_update_under_layouts_matches_one_process_plain():
    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    got = run_distributed(_worker, 2, path, timeout=300)[0]
    assert set(got) == set(LAYOUTS)
    assert_layouts_match_one_process(got, path, _with_values(_batch(GROUPS)), CFG)


UNEVEN = {
    0: ((12, 4), (20, 4)),
    1: ((16, 4),),
}  # rank -> groups; budget below splits rank 0's batch
UNEVEN_CFG = reference_update(micro_batch_tokens=100, max_grad_norm=0.0, share_prefix=True)


def _uneven_batch(rank: int):
    return _with_values(_batch(UNEVEN[rank], seed=rank))


def _uneven_worker(rank: int, world: int, path: str):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    layout = Layout(dp=2, tp=1)
    parallelize_model(
        model, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")), layout=layout
    )
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    mine = _uneven_batch(rank)
    micro = mine.split_by_tokens(UNEVEN_CFG.micro_batch_tokens)
    shares = [plan_shared_prefix(mb) is not None for mb in micro]
    update(Models(model), mine, UNEVEN_CFG, Reducer(layout))
    params = _params(Models(model))
    return {
        "forwards": len(forwards),
        "shares": shares,
        "params": {n: p.numpy() for n, p in params.items()} if rank == 0 else None,
    }


def test_ranks_that_disagree_or_pad_run_the_same_forwards():
    """dp=2 under FSDP with uneven micro-batches: rank 1 has fewer and pads with zero-loss passes;
    where some rank cannot share, no rank does. Every rank runs as many forwards as the others
    (else FSDP's all-gathers would hang), and the update equals one process's plain update."""
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    out = run_distributed(_uneven_worker, 2, path, timeout=300)
    assert len(out[0]["shares"]) > len(out[1]["shares"])  # rank 1 pads
    assert out[0]["forwards"] == out[1]["forwards"]
    expected_forwards = sum(
        2 if all(s) else 1 for s in zip(out[0]["shares"], out[1]["shares"] + [True] * 9)
    )
    # some passes were shared
    assert out[0]["forwards"] == expected_forwards > len(out[0]["shares"])
    whole = type(_uneven_batch(0)).concat([_uneven_batch(0), _uneven_batch(1)])
    ref = Models(AutoModelForCausalLM.from_pretrained(path))
    update(ref, whole, replace(UNEVEN_CFG, share_prefix=False), Reducer())
    for name, value in _params(ref).items():
        torch.testing.assert_close(
            torch.from_numpy(out[0]["params"][name]), value, rtol=1e-4, atol=1e-6, msg=name
        )

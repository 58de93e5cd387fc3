"""The scored last layer (``train/scored.py``) under the parallel layouts: FSDP2 over dp=2 (the
layer's all-gather and reshard hooks run around the replaced forward), TP=2 (each rank's heads),
and dp=2 with PPO's value head. One PPO update over multi-turn rows with the path on (and the
RMSNorms' written-out backward, ``train/rms_norm.py``, taken under FSDP2), on 2 processes, must end
at the parameters of the single-process update with the plain forward and autograd's norms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from earl_lightning.parallel.collectives import Reducer
from earl_lightning.train import forward as forward_mod
from earl_lightning.train import rms_norm
from earl_lightning.train.update import Models
from tests.distributed.launch import run_distributed
from tests.distributed.test_shared_prefix_layouts import (
    _with_values,
    assert_layouts_match_one_process,
    placed,
)
from tests.distributed.test_update_uneven import _params, update, value_head
from tests.unit.test_scored_last_layer import _batch
from tests.updates import reference_update

pytestmark = pytest.mark.distributed

CFG = reference_update(
    micro_batch_tokens=4096, max_grad_norm=0.0, value_coef=1.0, value_clip=None, entropy_coef=0.01
)
LAYOUTS = [(2, 1, False), (1, 2, False), (2, 1, True)]  # (dp, tp, with a value head)


def _worker(rank: int, world: int, path: str):
    taken, norms = [], []
    real = forward_mod.scored_last_layer
    forward_mod.scored_last_layer = lambda *a: taken.append(1) or real(*a)
    real_norm = rms_norm._RMSNorm.apply
    rms_norm._RMSNorm.apply = lambda *a: norms.append(1) or real_norm(*a)
    out = {}
    full = _with_values(_batch(rows=8))
    # the scored last layer, and the RMSNorms' written-out backward where the norms' weights are
    # plain tensors while they run (FSDP2 gathers them; tensor parallel leaves them to autograd)
    cfg = replace(CFG, scored_last_layer=True, rms_norm_backward=True)
    for dp, tp, with_value in LAYOUTS:
        taken.clear()
        norms.clear()
        model, layout, mine = placed(path, full, dp, tp)
        models = Models(model, value_head() if with_value else None)
        stats = update(models, mine, cfg, Reducer(layout))
        params = _params(models)  # a collective: every rank gathers
        out[(dp, tp, with_value)] = (
            (
                {n: p.numpy() for n, p in params.items()},
                stats["loss/policy"],
                len(taken),
                len(norms),
            )
            if rank == 0
            else None
        )
    return out


def test_scored_update_under_layouts_matches_one_process_plain():
    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    got = run_distributed(_worker, 2, path, timeout=300)[0]
    assert set(got) == set(LAYOUTS)
    for layout, (_, _, taken, norms) in got.items():
        assert taken >= 1, f"the scored path was not taken under (dp, tp, value head) = {layout}"
        if layout[1] == 1:
            assert norms >= 1, f"the written-out norm backward was not taken under {layout}"
    assert_layouts_match_one_process(got, path, _with_values(_batch(rows=8)), CFG)

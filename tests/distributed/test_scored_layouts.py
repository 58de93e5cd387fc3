"""The scored last layer (``train/scored.py``) under the parallel layouts: FSDP2 over dp=2 (the
layer's all-gather and reshard hooks run around the replaced forward), TP=2 (each rank's heads),
and dp=2 with PPO's value head. One PPO update over multi-turn rows with the path on, on 2
processes, must end at the parameters of the single-process update with the plain forward."""

from __future__ import annotations

from dataclasses import replace

import pytest

from earl_lightning.parallel.collectives import Reducer
from earl_lightning.train import forward as forward_mod
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
    taken = []
    real = forward_mod.scored_last_layer
    forward_mod.scored_last_layer = lambda *a: taken.append(1) or real(*a)
    out = {}
    full = _with_values(_batch(rows=8))
    for dp, tp, with_value in LAYOUTS:
        taken.clear()
        model, layout, mine = placed(path, full, dp, tp)
        models = Models(model, value_head() if with_value else None)
        stats = update(models, mine, replace(CFG, scored_last_layer=True), Reducer(layout))
        params = _params(models)  # a collective: every rank gathers
        out[(dp, tp, with_value)] = (
            ({n: p.numpy() for n, p in params.items()}, stats["loss/policy"], len(taken))
            if rank == 0
            else None
        )
    return out


def test_scored_update_under_layouts_matches_one_process_plain():
    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    got = run_distributed(_worker, 2, path, timeout=300)[0]
    assert set(got) == set(LAYOUTS)
    for layout, (_, _, taken) in got.items():
        assert taken >= 1, f"the scored path was not taken under (dp, tp, value head) = {layout}"
    assert_layouts_match_one_process(got, path, _with_values(_batch(rows=8)), CFG)

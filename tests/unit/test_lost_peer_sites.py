"""Every collective of a step outside the stages ends the run with the one-line RankFailure when a
peer is lost there, like a stage does: a single-process run whose collective at one site raises
the error gloo raises for a killed peer (the real thing on 2 processes:
tests/distributed/test_peer_faults.py, tests/e2e/test_silent_rank.py)."""

from __future__ import annotations

import re

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from earl_lightning.core.errors import RankFailure
from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.metrics import RunMetrics
from tests.unit.test_adaptive import datamodule, module, trainer

# as raised by torch 2.13's gloo when the peer of an all-reduce was SIGKILLed
GLOO_PEER_DIED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17644: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


def peer_dies(*args, **kwargs):
    raise RuntimeError(GLOO_PEER_DIED)


def dies_at_save(self, name=None):
    if name == "Trainer.save_checkpoint":
        peer_dies()


@pytest.mark.parametrize(
    "target, where",
    [
        ("earl_lightning.modules.rl.check_env_failures", r"the env-failure check of RL step 0"),
        ("earl_lightning.modules.rl.batch_stats", r"the batch statistics of RL step 0"),
        (
            "earl_lightning.modules.metrics.zero_spread_share",
            r"the step's metric reductions of RL step 0",
        ),
        ("first_eval", r"the evaluation's metric reductions of global step 0"),
        ("eval", r"the evaluation's metric reductions of global step \d"),
        (
            "save",
            r"the strategy's barrier 'Trainer.save_checkpoint' in on_train_batch_end of global step 1",
        ),
    ],
)
def test_a_lost_peer_outside_the_stages_is_one_line(tmp_path, monkeypatch, target, where):
    callbacks, dm, rl = [], datamodule(eval_episodes=2 if "eval" in target else 0), module()
    # the evaluation before the first update computes (syncs) its metrics
    if target == "first_eval":
        monkeypatch.setattr(RunMetrics, "compute_val", peer_dies)
    # a validation run after step 1: Lightning computes the logged metric objects
    elif target == "eval":
        monkeypatch.setattr(AgenticRLModule, "on_train_start", lambda self: None)
        monkeypatch.setattr(rl.run_metrics.val_episodes["env__errors"], "compute", peer_dies)
    elif target == "save":
        monkeypatch.setattr(ModelParallelStrategy, "barrier", dies_at_save)
        callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)]
    else:
        monkeypatch.setattr(target, peer_dies)
    t = trainer(tmp_path, callbacks, steps=1)
    t.limit_val_batches = 1 if "eval" in target else 0
    with pytest.raises(RankFailure) as raised:
        t.fit(rl, dm)
    line = str(raised.value)
    assert re.match(
        rf"rank 0 lost a peer during {where}: another process died \(RuntimeError: \[/pytorch/",
        line,
    ), line
    assert "\n" not in line and (tmp_path / "rank0_failure.log").is_file()

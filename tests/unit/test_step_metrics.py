"""The RL step's metrics reach the same places ``self.log_dict(..., on_step=True)`` put them,
without its cost (``modules/step_logging.py: _publish``): ``trainer.callback_metrics`` and
``trainer.logged_metrics`` every step, and the loggers at Lightning's cadence and x-axis. The
reference is Lightning's own path in the same run: ``reward/mean`` still goes through
``self.log`` (the progress bar shows it)."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.unit.test_adaptive import datamodule, module, trainer


class Seen(Callback):
    """What a callback reads at each step's end."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(dict(trainer.callback_metrics))


def test_step_metrics_reach_callbacks_every_step_and_the_logger_at_lightnings_steps(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    seen = Seen()
    t = trainer(tmp_path, [seen], steps=5, logger=logger, log_every_n_steps=2)
    t.fit(module(), datamodule())
    # every step, a callback reads this step's figures, as tensors, beside Lightning's own
    assert len(seen.steps) == 5
    for metrics in seen.steps:
        assert {"reward/mean", "tokens/generated", "grad_norm", "oom/recoveries"} <= set(metrics)
        assert all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in metrics.values())
    iterations = [float(m["rl/iteration"]) for m in seen.steps]
    assert iterations == sorted(set(iterations)) and len(iterations) == 5  # this step's, not stale
    assert "oom/recoveries" in t.logged_metrics and "tokens/generated" in t.logged_metrics
    # the logger: every metric at the steps (and x-axis values) Lightning wrote reward/mean at
    acc = EventAccumulator(str(Path(logger.log_dir)))
    acc.Reload()
    lightning_steps = [e.step for e in acc.Scalars("reward/mean")]
    assert lightning_steps == [1, 3]  # log_every_n_steps 2 over 5 steps
    for tag in ("tokens/generated", "grad_norm", "oom/recoveries", "rl/iteration"):
        assert [e.step for e in acc.Scalars(tag)] == lightning_steps, tag
    logged = {e.step: e.value for e in acc.Scalars("rl/iteration")}
    assert logged == {1: iterations[1], 3: iterations[3]}

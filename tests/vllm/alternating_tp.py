"""A callback for the vLLM recipe test: every rollout flips the rollout layout between TP 1 and
TP 2, so a real `earl fit` run switches the engine's TP degree mid-run (the selector's job in
production). Loaded by LightningCLI from ``--trainer.callbacks+=tests.vllm.alternating_tp.AlternatingRolloutTP``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import Callback

from earl_lightning.parallel.layout import Layout


class _Alternate:
    """Rollout: TP 1, 2, 1, 2, ... per call; every other stage: the train layout."""

    def __init__(self, train: Layout):
        self.train, self.rollouts = train, 0

    def select(self, stage: str, stats: Mapping[str, Any] | None, current: Layout) -> Layout:
        if stage != "rollout":
            return self.train
        tp = 2 if self.rollouts % 2 else 1
        self.rollouts += 1
        return Layout(dp=self.train.world_size // tp, tp=tp)


class AlternatingRolloutTP(Callback):
    def setup(self, trainer, pl_module, stage: str) -> None:
        trainer.strategy.register_selector(_Alternate(trainer.strategy.train_layout))

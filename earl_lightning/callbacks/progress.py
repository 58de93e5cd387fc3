"""A progress bar for step-based runs: ``step k/max_steps``, the module's ``prog_bar`` metrics, no ``v_num``.

An RL run here is step-based (an infinite episode stream, ``max_steps`` set, ``max_epochs`` unset), so
Lightning's own bars read ``Epoch 0/-2`` with an unknown total; this one counts ``trainer.global_step``
(one RL iteration each) against ``trainer.max_steps``. Runs without ``max_steps`` keep Lightning's epoch bar.

It is a TQDM bar, not a Rich one: tqdm is a dependency of Lightning itself, while ``rich`` is only
present when another package pulls it in, so this bar looks the same on every install; and written to
a log file it keeps updating, where Rich prints only the final state.

    Trainer(max_steps=200, callbacks=[StepProgressBar()])  # the `earl` CLI adds it by default
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    """TQDM progress bar that counts optimizer steps (RL iterations) against ``trainer.max_steps``."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        # Only what the module logged with prog_bar=True: `v_num` (the logger's version) is not progress.
        return dict(trainer.progress_bar_metrics)

    @property
    @override
    def train_description(self) -> str:
        return "step" if self.trainer.max_steps > 0 else super().train_description

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        if trainer.max_steps > 0:
            bar = self.train_progress_bar
            bar.reset(total=trainer.max_steps)
            # A resumed run starts part way; `initial` keeps the it/s rate to this run's own steps.
            bar.initial = bar.n = trainer.global_step
            bar.refresh()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # A step bar spans epochs (and a run resumed mid-epoch gets no epoch start): it is set up once,
        # in on_train_start.
        if trainer.max_steps <= 0:
            super().on_train_epoch_start(trainer, *args)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.max_steps <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        step = trainer.global_step
        if (
            self.is_enabled
            and not bar.disable
            and (step % self.refresh_rate == 0 or step == bar.total)
        ):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # also redraws the bar

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        # One evaluation loader: say which step is being evaluated rather than "DataLoader 0".
        if (
            not trainer.sanity_checking
            and trainer.state.fn == "fit"
            and len(trainer.num_val_batches) == 1
        ):
            self.val_progress_bar.set_description(
                f"{self.validation_description} at step {trainer.global_step}"
            )

"""The evaluation of :class:`~earl_lightning.modules.rl.AgenticRLModule`: greedy episodes into
the validation metrics, sampled ones (``--data.eval_samples``) into pass@k and mean@n, and the
first evaluation before any update (the learning curve's step 0).

A mixin of the module (as Lightning's own hooks are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.metrics import log_at_global_step, reported
from earl_lightning.stages import StageTimer
from earl_lightning.strategies.faults import trainer_lost_peer

if TYPE_CHECKING:  # the class this mixin's hooks override, for type checkers' @override checks
    from lightning.pytorch import LightningModule as _Hooked
else:
    _Hooked = object


class EvaluationHooks(_Hooked):
    """validation_step, its epoch end and on_train_start's first evaluation."""

    def _evaluate(self, batch: dict[str, Any]) -> dict[str, bool]:
        """Play the batch's ``specs`` greedily into the validation metrics and its ``sampled``
        ones (``--data.eval_samples``) with the training's sampling into pass@k and mean@n;
        which optional rates the greedy episodes report."""
        specs, runner = batch["specs"], self._runner(StageTimer())
        for attempt in runner.attempts("rollout", self._spec_stats(specs)):
            with attempt as ctx:
                episodes = self._play(specs, ctx, seed=0, greedy=True)
        self.run_metrics.update_val(episodes, ctx.reduce.counts_here)
        if batch["sampled"]:
            for attempt in runner.attempts("rollout", self._spec_stats(batch["sampled"])):
                with attempt as sampled_ctx:  # the module's seed: the same draws every evaluation
                    sampled = self._play(batch["sampled"], sampled_ctx, seed=self.hparams.seed)
            self.sampled_eval.update(sampled, sampled_ctx.reduce.counts_here)
        phase = "sanity" if self.trainer.sanity_checking else "val"
        self._show_episodes(episodes, self.global_step, phase, ctx.reduce.counts_here)
        with runner.outside("the evaluation's metric reductions"):
            return {flag: ctx.reduce.any(value) for flag, value in reported(episodes).items()}

    @override
    def on_validation_epoch_end(self) -> None:
        # Lightning computes the logged metric objects after this hook; computing them here puts
        # their synchronization under the one-line lost-peer error (torchmetrics keeps the result).
        with trainer_lost_peer(self.trainer).during("the evaluation's metric reductions"):
            for metric in [
                *self.run_metrics.val_objects({}).values(),
                *self.sampled_eval.objects().values(),
            ]:
                metric.compute()

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        flags = self._evaluate(batch)
        objects = {**self.run_metrics.val_objects(flags), **self.sampled_eval.objects()}
        for name, metric in objects.items():
            self.log(
                name,
                metric,
                prog_bar=name == "val/win_rate",
                on_step=False,
                on_epoch=True,
                batch_size=1,
            )
        log_at_global_step(self)

    @override
    def on_train_start(self) -> None:
        # The first evaluation, before any update: the learning curve's baseline at step 0.
        dm = self.trainer.datamodule
        if (
            self.global_step == 0
            and isinstance(dm, EpisodeDataModule)
            and dm.eval_episodes
            and self.trainer.val_dataloaders is not None
            and self.trainer.limit_val_batches
        ):
            flags = self._evaluate(next(iter(dm.val_dataloader())))
            with trainer_lost_peer(self.trainer).during("the evaluation's metric reductions"):
                values = {**self.run_metrics.compute_val(flags), **self.sampled_eval.compute()}
            for logger in self.loggers:
                logger.log_metrics(values, step=0)

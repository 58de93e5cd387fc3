"""What :class:`~earl_lightning.modules.rl.AgenticRLModule` logs after each RL iteration: the
step's metrics (reduced over all ranks), the learning-signal check and the episodes it shows.

A mixin of the module (as Lightning's own hooks are): it reads the module's configuration, its
metrics objects and its stage runner, and writes through ``self.log``.
"""

from __future__ import annotations

import torch

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.core import console
from earl_lightning.core.lightning_internals import logging_step
from earl_lightning.modules.dynamic_sampling import Draws
from earl_lightning.modules.metrics import episode_metrics
from earl_lightning.modules.signal import METRIC as NO_SIGNAL
from earl_lightning.rollout.weight_sync import step_mismatch
from earl_lightning.stages import StageContext, StageRunner


class StepLogging:
    """The step's metrics, the learning-signal check and the transcripts of AgenticRLModule."""

    def _step_metrics(
        self,
        runner: StageRunner,
        draws: Draws,
        num_groups: int,
        exp: ExperienceBatch,
        update: dict[str, float],
        rollout_ctx: StageContext,
        train_ctx: StageContext,
    ) -> dict[str, float]:
        """The step's logged metrics, each reduced over all ranks (every rank calls this); the
        episodes' figures are those of the step's own batch (``draws.first``)."""
        episodes = draws.first
        metrics = self.run_metrics.step(
            episodes, rollout_ctx.reduce.counts_here, exp, train_ctx.reduce.counts_here
        )
        for more in (
            runner.timer.metrics(metrics["tokens/generated"], metrics["tokens/total"]),
            update,
            self._stages().pop_stage_metrics(),
            self._exchanger().pop_metrics(),
            self._backend.metrics(),
            draws.metrics(),
            self.algorithm_config.overlong.metrics(episodes, rollout_ctx.reduce),
        ):
            metrics.update(more)
        measured = update.pop("logprob/mismatch") if self._on_policy else None
        warn = self.hparams.logprob_mismatch_warn
        metrics["logprob/mismatch"] = step_mismatch(exp.tokens, train_ctx.reduce, measured, warn)
        names = [f.name for f in self._reward_funcs()]
        tools = self.rollout_config.tool_parser is not None
        metrics.update(
            episode_metrics(
                episodes, num_groups, rollout_ctx.reduce, names, self._reward_outcomes, tools
            )
        )
        metrics.update(
            {"rl/iteration": float(self.rl_iteration), "oom/recoveries": float(self.oom_recoveries)}
        )
        return metrics

    def _log_step(
        self, metrics: dict[str, float], episodes: list, step: int, counted: bool
    ) -> None:
        for name in ("reward/mean", "env/win_rate"):
            if name in metrics:
                self.log(name, metrics.pop(name), prog_bar=True, on_step=True, rank_zero_only=True)
        self._log_signal(metrics["reward/zero_std_groups"], metrics["grad_norm"])
        self._publish(metrics)
        self._show_episodes(episodes, step, "train", counted)

    def _publish(self, metrics: dict[str, float]) -> None:
        """The step's other metrics where ``self.log_dict(metrics, on_step=True)`` puts them, at a
        fraction of its cost: ``trainer.callback_metrics`` and ``trainer.logged_metrics`` every
        step (what callbacks such as ``ModelCheckpoint(monitor=...)`` read, as tensors), and the
        loggers on the steps Lightning writes them, at its x-axis.
        ``self.log`` costs about a millisecond per scalar (each value's result metric is moved to
        its device, deep copies included), ~30 ms a step for the ~30 figures here
        (``benchmarks/step_overheads.py``)."""
        trainer = self.trainer
        values = {name: torch.tensor(float(value)) for name, value in metrics.items()}
        trainer.callback_metrics.update(values)
        trainer.logged_metrics.update(values)
        step, write = logging_step(trainer)
        if write:
            for logger in self.loggers:
                logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def _log_signal(self, zero_std_groups: float, grad_norm: float) -> None:
        """The learning-signal check: its count in TensorBoard every step, in the progress bar
        from its one warning on (0 again once the signal is back)."""
        warning = self.signal.update(zero_std_groups, grad_norm)
        if warning is not None:
            console.warn(warning)
        self.log(NO_SIGNAL, float(self.signal.streak), on_step=True, rank_zero_only=True)
        if self.signal.warned:
            self.log("no_signal_steps", float(self.signal.streak), prog_bar=True, logger=False)

    def _show_episodes(self, episodes: list, step: int, phase: str, counted: bool) -> None:
        self.episode_log.show(
            episodes, step, phase, self.loggers, self.tokenizer, self.global_rank, counted
        )

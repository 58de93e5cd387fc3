"""AdaptiveParallelism: drives the layout :class:`Selector` of :class:`EarlStrategy` from a Trainer.

At fit start it builds the memory model from the module's policy (its config, dtype, optimizer,
reference model, generation backend), loads a profiled throughput table (or measures one within a
time budget), and registers a selector with the strategy. From then on every ``strategy.stage``
asks it for the stage's layout; every decision is logged (``layout/<stage>/tp`` and ``dp`` by the
strategy, the predicted memory and throughput here, the reason as TensorBoard text). On an
out-of-memory error inside a stage it marks the layout infeasible for that size and lets the
module retry the stage under the next layout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Literal, Union

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from earl_lightning.callbacks.adaptive_setup import (
    GIB,
    budget_bytes,
    candidate_layouts,
    check_arguments,
    checkpointing_choices,
    memory_model_of,
    optimizer_name,
    policy_of,
    profile_at_fit_start,
    stage_candidates,
    workload_of,
)
from earl_lightning.core import console
from earl_lightning.parallel.decision import Decision, bucket_of
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.selector import Selector
from earl_lightning.parallel.throughput import ProfileTable, layout_key
from earl_lightning.stages import StageOOMHandler

# The decisions `history` keeps (three a step: rollout, experience, train): the last hundred steps'.
HISTORY_DECISIONS = 300
STATE_VERSION = 1
CONTEXT_KEYS = ("context_mean", "context_max", "context_p95", "prompt_max", "turn_prefill_max")
LayoutLike = Union[Layout, Mapping[str, Any]]  # noqa: UP007 - an alias jsonargparse reads at run time


class AdaptiveParallelism(StageOOMHandler):
    """Choose every RL stage's parallel layout at every step (needs ``EarlStrategy``).

    Args:
        profile: a profile table saved by ``earl profile`` (JSON); it must match the run's model
            and world size.
        profile_budget_s: instead, profile every candidate at fit start for at most this long.
        profile_contexts: context lengths to profile (default: powers of 4 from 256 up to the
            module's ``max_context_tokens``).
        profile_out: directory where a profile measured at fit start is saved (JSON + heatmaps);
            a relative path is taken under the Trainer's ``default_root_dir``.
        memory_budget_gb / memory_budget_bytes: memory per device the layouts must fit (default:
            the strategy's ``memory_budget_gb``, else the device's total memory: the GPU's, or the
            host's RAM divided by the processes on the node).
        safety_margin: fraction of the budget kept free for what the memory model does not count.
        hysteresis: a new layout must be more than this fraction faster to replace the current one.
        candidates: ``"auto"`` (every dp x tp of the world size whose tp divides the heads, within
            the strategy's candidate ``layouts`` when it lists some) or a list of layouts.
        micro_batch_tokens: micro-batch budgets to choose from, per placement (default: the
            module's ``micro_batch_tokens`` and its half and quarter). The train stage keeps the
            strategy's train placement and only chooses among these.
        activation_checkpointing: for the train stage, whether to recompute activations in
            backward: ``[False, True]`` lets the selector choose per step (recompute costs about
            one extra forward, and saves most activation memory at long contexts); default: the
            train layout's own setting.
        amortize_steps: steps over which one layout switch is expected to pay off.

    Raises:
        ValueError: a setting out of range or two that exclude each other (``profile`` and
            ``profile_budget_s``; both memory budgets); at setup, a Trainer whose strategy is not
            ``EarlStrategy``; at a stage, no candidate layout that fits the memory budget
            (``NoFeasibleLayoutError``).
        ProfileError: at setup, a ``profile`` file that is unreadable or corrupt, or was measured
            for another world size.
    """

    def __init__(
        self,
        profile: str | None = None,
        profile_budget_s: float | None = None,
        profile_contexts: list[int] | None = None,
        profile_out: str | None = None,
        memory_budget_gb: float | None = None,
        memory_budget_bytes: int | None = None,
        safety_margin: float = 0.1,
        hysteresis: float = 0.1,
        candidates: Literal["auto"] | list[LayoutLike] = "auto",
        micro_batch_tokens: list[int] | None = None,
        activation_checkpointing: list[bool] | None = None,
        amortize_steps: int = 1,
    ) -> None:
        super().__init__()
        check_arguments(
            profile, profile_budget_s, memory_budget_gb, memory_budget_bytes, micro_batch_tokens
        )
        self.activation_checkpointing = checkpointing_choices(activation_checkpointing)
        candidates = candidate_layouts(candidates)
        self.profile, self.profile_budget_s = profile, profile_budget_s
        self.profile_contexts, self.profile_out = profile_contexts, profile_out
        self.memory_budget_gb, self.memory_budget_bytes = memory_budget_gb, memory_budget_bytes
        self.safety_margin, self.hysteresis, self.amortize_steps = (
            safety_margin,
            hysteresis,
            amortize_steps,
        )
        self.candidates, self.micro_batch_tokens = candidates, micro_batch_tokens
        self.selector: Selector | None = None
        self.table: ProfileTable | None = None
        # the latest decisions (step, stage, layout, reason, ...); bounded: a long run keeps no more
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_DECISIONS)
        self.oom_events: list[dict[str, Any]] = []
        self._step_decisions: dict[str, Decision] = {}
        self._last_context: dict[str, float] | None = None
        self._pending_state: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None
        self._default_context = 1.0

    # ---- Lightning hooks -------------------------------------------------------------------
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from earl_lightning.strategies import EarlStrategy

        if not isinstance(trainer.strategy, EarlStrategy):
            raise ValueError(
                f"AdaptiveParallelism chooses layouts through EarlStrategy; the Trainer's strategy is "
                f"{type(trainer.strategy).__name__}. Use `Trainer(strategy=EarlStrategy())` "
                f"(or `trainer.strategy: earl` in a recipe)"
            )
        self._trainer = trainer
        train = trainer.strategy.train_layout
        if any(a != train.activation_checkpointing for a in self.activation_checkpointing or ()):
            # wrap the layers once, recompute per choice
            trainer.strategy.checkpoint_switchable = True
        if self.profile is not None:  # a corrupt or mismatched file fails before any model is built
            self.table = ProfileTable.load(self.profile, world_size=trainer.world_size)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Built here, not in setup(): the model exists after configure_model and the optimizer after
        # the strategy's setup, and both size the memory model.
        if self.selector is None:
            self.build(trainer, pl_module)

    def build(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Selector:
        """Build the memory model and the selector and register them with the strategy."""
        strategy = trainer.strategy
        model, work = policy_of(pl_module, strategy), workload_of(pl_module)
        memory = memory_model_of(
            model.config,
            str(next(model.parameters()).dtype),
            optimizer_name(trainer),
            work,
            resident_train_state=strategy.root_device.type == "cuda",
        )
        self._default_context = float(work.max_context_tokens)
        per_stage = stage_candidates(
            strategy,
            memory,
            work,
            self.candidates,
            self.micro_batch_tokens,
            self.activation_checkpointing,
        )
        if self.table is None and self.profile_budget_s is not None:
            self.table = profile_at_fit_start(
                trainer,
                pl_module,
                model,
                per_stage,
                work,
                default_context=self._default_context,
                contexts=self.profile_contexts,
                budget_s=self.profile_budget_s,
                out_dir=self.profile_out,
            )
        self.selector = Selector(
            per_stage,
            memory,
            self.table,
            budget_bytes(trainer, self.memory_budget_bytes, self.memory_budget_gb),
            safety_margin=self.safety_margin,
            hysteresis=self.hysteresis,
            amortize_steps=self.amortize_steps,
        )
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        strategy.register_selector(_StageSelector(self))
        console.info(
            f"AdaptiveParallelism: budget {self.selector.budget_bytes / GIB:.2f} GiB per device, "
            f"candidates { {s: [layout_key(c) for c in v] for s, v in per_stage.items()} }, "
            f"profile: {'none' if self.table is None else f'{len(self.table)} cells'}"
        )
        return self.selector

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        decisions, self._step_decisions = self._step_decisions, {}
        if trainer.global_rank != 0 or not decisions:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                for stage, d in decisions.items():
                    logger.experiment.add_text(f"layout/{stage}", _describe(d), trainer.global_step)

    def on_stage_oom(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        stage: str,
        stats: Mapping[str, Any] | None,
        err: BaseException,
    ) -> bool:
        """Mark the stage's current layout infeasible at this size; True when another layout is left."""
        if self.selector is None or stage not in self.selector.last_decisions:
            return False
        failed = self.selector.last_decisions[stage].layout
        full = self.complete_stats(stage, stats)
        bucket = bucket_of(full)
        self.selector.mark_infeasible(stage, bucket, failed)
        left = [
            layout_key(c)
            for c in self.selector.candidates(stage)
            if not self.selector.is_infeasible(stage, bucket, c)
            and self.selector.estimate(stage, c, full).total <= self.selector.usable_bytes
        ]
        self.oom_events.append(
            dict(
                step=trainer.global_step,
                stage=stage,
                layout=layout_key(failed),
                error=f"{type(err).__name__}: {str(err)[:200]}",
                left=left,
            )
        )
        console.warn(
            f"out of memory in stage {stage!r} under {layout_key(failed)} ({type(err).__name__}: "
            f"{str(err)[:120]}); marked infeasible at context<={bucket.context}, "
            f"num_seqs<={bucket.num_seqs}; "
            + (f"retrying with one of {left}" if left else "no other layout fits: giving up")
        )
        return bool(left)

    # ---- state -----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.selector is None:
            return dict(self._pending_state or {})
        return {
            "version": STATE_VERSION,
            "selector": self.selector.state_dict(),
            "last_context": self._last_context,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                f"AdaptiveParallelism state must have version {STATE_VERSION}, "
                f"got {state_dict.get('version')!r}"
            )
        if self.selector is None:  # restored before fit start: applied once the selector exists
            self._pending_state = dict(state_dict)
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        self.selector.load_state_dict(state["selector"])
        self.table = self.selector.table
        self._last_context = dict(state["last_context"]) if state.get("last_context") else None

    # ---- deciding --------------------------------------------------------------------------
    def complete_stats(self, stage: str, stats: Mapping[str, Any] | None) -> dict[str, float]:
        """The stats the selector needs. Rollout starts before any context exists: its contexts
        are predicted by the previous step's final contexts (what the KV cache held at the end)
        and its prefills by the previous step's longest prompt and turn, or all by the module's
        ``max_context_tokens`` on the first step (the safe bound)."""
        s = {k: float(v) for k, v in (stats or {}).items()}
        s.setdefault("gen_len", 0.0)
        if "context_max" not in s:
            prev = self._last_context or dict.fromkeys(CONTEXT_KEYS, self._default_context)
            s.update({k: prev.get(k, prev["context_max"]) for k in CONTEXT_KEYS})
        elif stage == "experience":  # the sequences the next rollout will grow to
            self._last_context = {k: s.get(k, s["context_max"]) for k in CONTEXT_KEYS}
        s["num_seqs"] = max(1.0, s.get("num_seqs", 1.0))
        for k in CONTEXT_KEYS:
            s[k] = max(0.0 if k == "turn_prefill_max" else 1.0, s.get(k, s["context_max"]))
        return s

    def decide(self, stage: str, stats: Mapping[str, Any] | None, current: Layout | None) -> Layout:
        """The layout ``stage`` runs under this step, chosen by the selector from the completed
        ``stats`` (:meth:`complete_stats`) and the ``current`` layout (switching costs a reshard,
        so it must pay off); the decision joins :attr:`history` and the stage's layout metrics.

        Raises:
            NoFeasibleLayoutError: no candidate layout fits the memory budget.
        """
        full = self.complete_stats(stage, stats)
        d = self.selector.decide(stage, full, current)
        self._step_decisions[stage] = d
        step = self._trainer.global_step if self._trainer is not None else 0
        self.history.append(
            dict(
                step=step,
                stage=stage,
                layout=layout_key(d.layout),
                switched=d.switched,
                predicted_bytes=d.predicted_bytes,
                predicted_tokens_per_s=d.predicted_tokens_per_s,
                reason=d.reason,
                context_mean=full["context_mean"],
                num_seqs=full["num_seqs"],
            )
        )
        if self._trainer is not None:  # the strategy logs these with the stage's layout
            metrics = self._trainer.strategy.stage_metrics
            metrics[f"layout/{stage}/predicted_mib"] = d.predicted_bytes / 2**20
            metrics[f"layout/{stage}/micro_batch_tokens"] = float(d.layout.micro_batch_tokens)
            if stage == "train":
                metrics["layout/train/activation_checkpointing"] = float(
                    d.layout.activation_checkpointing
                )
            metrics[f"layout/{stage}/switched"] = float(d.switched)
            if d.predicted_tokens_per_s is not None:
                metrics[f"layout/{stage}/predicted_tokens_per_s"] = float(d.predicted_tokens_per_s)
        return d.layout


class _StageSelector:
    """What EarlStrategy calls: ``select(stage, stats, current) -> Layout``."""

    def __init__(self, callback: AdaptiveParallelism) -> None:
        self.callback = callback

    def select(self, stage: str, stats: Mapping[str, Any] | None, current: Layout) -> Layout:
        return self.callback.decide(stage, stats, current)


def _describe(d: Decision) -> str:
    tps = f"{d.predicted_tokens_per_s:.0f} tok/s" if d.predicted_tokens_per_s else "no profile"
    return (
        f"**{layout_key(d.layout)}** (dp={d.layout.dp}, tp={d.layout.tp}, micro_batch_tokens="
        f"{d.layout.micro_batch_tokens}, activation_checkpointing={d.layout.activation_checkpointing}); "
        f"predicted {d.predicted_bytes / 2**20:.1f} MiB, {tps}; "
        f"bucket context<={d.bucket.context}, num_seqs<={d.bucket.num_seqs}. {d.reason}"
    )


__all__ = ["AdaptiveParallelism"]

"""Pick a layout for an RL stage from memory estimates, a profiled throughput table, hysteresis
and the cost of switching.

For each call: (a) drop the candidates the memory model says do not fit the per-device budget
(minus a safety margin) and those marked infeasible after a real out-of-memory error; (b) predict
each survivor's stage time from the table (interpolated) plus the switch cost from the layout
the model is in now; (c) keep the stage's previous choice unless the best is more than
``hysteresis`` faster, so that statistics hovering at a bucket edge do not flip the layout back
and forth. Every call returns a :class:`Decision` that says why.

Pure Python; the strategy and the AdaptiveParallelism callback drive it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, Union

from earl_lightning.core.checks import check_count, check_number
from earl_lightning.parallel.decision import (
    Bucket,
    CandidateReport,
    Decision,
    bucket_of,
    choose,
    gib,
)
from earl_lightning.parallel.layout import STAGES, Layout, check_stage
from earl_lightning.parallel.memory import MemoryEstimate, MemoryModel
from earl_lightning.parallel.throughput import ProfileTable, layout_key, work_tokens

STATE_VERSION = 1
SwitchCost = Union[Mapping[str, float], Callable[[str, Layout, Layout], float], None]  # noqa: UP007


class NoFeasibleLayoutError(ValueError):
    """No candidate layout fits the memory budget (or all that fit were marked infeasible)."""


class Selector:
    """Chooses a layout per stage and step.

    Args:
        candidates: the layouts to choose from (all stages), or a dict stage -> layouts.
        memory_model: predicts each layout's peak bytes per rank.
        table: profiled throughput (None: no profile; the selector then keeps what fits).
        budget_bytes: memory per device.
        safety_margin: fraction of ``budget_bytes`` kept free for what the model does not count.
        hysteresis: a new layout must be more than this fraction faster to replace the stage's
            current choice.
        switch_cost_s: seconds to move the model into another layout (reshard, engine rebuild):
            a dict stage -> seconds (refined by :meth:`observe_switch`), or a callable
            ``(stage, from_layout, to_layout) -> seconds``.
        amortize_steps: steps over which one switch is expected to pay off.
    """

    def __init__(
        self,
        candidates: Sequence[Layout] | Mapping[str, Sequence[Layout]],
        memory_model: MemoryModel,
        table: ProfileTable | None,
        budget_bytes: int,
        safety_margin: float = 0.1,
        hysteresis: float = 0.1,
        switch_cost_s: SwitchCost = None,
        amortize_steps: int = 1,
    ) -> None:
        if not isinstance(memory_model, MemoryModel):
            raise ValueError(
                f"`memory_model` must be a MemoryModel, got {type(memory_model).__name__}"
            )
        self.memory_model = memory_model
        self._candidates = self._check_candidates(candidates)
        self._check_numbers(budget_bytes, safety_margin, hysteresis, amortize_steps)
        self.budget_bytes, self.safety_margin, self.hysteresis = (
            budget_bytes,
            float(safety_margin),
            float(hysteresis),
        )
        self.amortize_steps = amortize_steps
        self._switch_fn, self._switch_cost = self._check_switch_cost(switch_cost_s)
        self._observed: dict[str, tuple[int, float]] = {}
        self.table: ProfileTable | None = None
        self.set_table(table)
        self._choices: dict[str, Layout] = {}
        self._infeasible: set[tuple[str, int, int, str]] = set()
        self.last_decisions: dict[str, Decision] = {}

    # ---- validation ---------------------------------------------------------------------
    def _check_candidates(self, candidates: Any) -> dict[str, list[Layout]]:
        per_stage = (
            dict(candidates) if isinstance(candidates, Mapping) else {s: candidates for s in STAGES}
        )
        unknown = [s for s in per_stage if s not in STAGES]
        missing = [s for s in STAGES if s not in per_stage]
        if unknown or missing:
            raise ValueError(
                f"`candidates` dict must have exactly the stages {list(STAGES)}; "
                f"unknown: {unknown}, missing: {missing}"
            )
        world = None
        z = self.memory_model.sizes
        for stage, layouts in per_stage.items():
            arg = "candidates" if not isinstance(candidates, Mapping) else f"candidates['{stage}']"
            layouts = list(layouts) if isinstance(layouts, (list, tuple)) else layouts
            if not isinstance(layouts, list) or not layouts:
                raise ValueError(f"`{arg}` must be a non-empty list of Layout, got {layouts!r}")
            for i, lay in enumerate(layouts):
                if not isinstance(lay, Layout):
                    raise ValueError(f"`{arg}[{i}]` must be a Layout, got {lay!r}")
                world = world or lay.world_size
                lay.check_world(world, arg=f"{arg}[{i}]")
                lay.check_heads(z.num_heads, z.num_kv_heads, arg=f"{arg}[{i}]")
            keys = [layout_key(lay) for lay in layouts]
            if len(set(keys)) != len(keys):
                raise ValueError(
                    f"`{arg}` has duplicate layouts: {sorted({k for k in keys if keys.count(k) > 1})}"
                )
            per_stage[stage] = layouts
        self.world_size = world
        return per_stage

    @staticmethod
    def _check_numbers(
        budget_bytes: Any, safety_margin: Any, hysteresis: Any, amortize_steps: Any
    ) -> None:
        per_device = " of bytes per device"
        check_number("budget_bytes", budget_bytes, low=0, strict=True, unit=per_device)
        check_number("safety_margin", safety_margin, low=0, high=1, strict_high=True)
        check_number("hysteresis", hysteresis, low=0)
        check_count("amortize_steps", amortize_steps)

    @staticmethod
    def _check_switch_cost(cost: SwitchCost) -> tuple[Callable | None, dict[str, float]]:
        if cost is None:
            return None, {}
        if callable(cost):
            return cost, {}
        if not isinstance(cost, Mapping):
            raise ValueError(
                f"`switch_cost_s` must be a dict stage -> seconds or a callable, got {cost!r}"
            )
        for stage, v in cost.items():
            if stage not in STAGES:
                raise ValueError(
                    f"`switch_cost_s` has unknown stage {stage!r}; valid stages: {list(STAGES)}"
                )
            check_number(f"switch_cost_s['{stage}']", v, low=0)
        return None, {s: float(v) for s, v in cost.items()}

    # ---- configuration ------------------------------------------------------------------
    def set_table(self, table: ProfileTable | None) -> None:
        if table is not None and not isinstance(table, ProfileTable):
            raise ValueError(f"`table` must be a ProfileTable or None, got {type(table).__name__}")
        if table is not None:
            table.check_matches(world_size=self.world_size)
        self.table = table

    def candidates(self, stage: str) -> list[Layout]:
        return list(self._candidates[check_stage(stage)])

    @property
    def choices(self) -> dict[str, Layout]:
        """The current layout of each stage decided so far."""
        return dict(self._choices)

    def switch_cost(self, stage: str, current: Layout | None, new: Layout) -> float:
        """Seconds to move from ``current`` to ``new`` (0 when they are the same or unknown)."""
        if current is None or layout_key(current) == layout_key(new):
            return 0.0
        if self._switch_fn is not None:
            return float(self._switch_fn(stage, current, new))
        if stage in self._observed:
            return self._observed[stage][1]
        return self._switch_cost.get(stage, 0.0)

    def observe_switch(self, stage: str, seconds: float) -> None:
        """Record a measured switch time; later decisions use the running mean for the stage."""
        check_stage(stage)
        check_number("seconds", seconds, low=0)
        n, mean = self._observed.get(stage, (0, 0.0))
        self._observed[stage] = (n + 1, mean + (float(seconds) - mean) / (n + 1))

    # ---- out-of-memory recovery ---------------------------------------------------------
    def mark_infeasible(
        self, stage: str, bucket: Bucket | Mapping[str, Any], layout: Layout
    ) -> None:
        """After a real OOM: ``layout`` is not used again for ``stage`` at this bucket or any
        larger one (more context or more sequences never need less memory)."""
        check_stage(stage)
        b = bucket if isinstance(bucket, Bucket) else bucket_of(bucket)
        self._infeasible.add((stage, b.context, b.num_seqs, layout_key(layout)))
        if stage in self._choices and layout_key(self._choices[stage]) == layout_key(layout):
            del self._choices[stage]  # the next decision must not prefer it as the incumbent

    def is_infeasible(self, stage: str, bucket: Bucket, layout: Layout) -> bool:
        key = layout_key(layout)
        return any(
            s == stage and k == key and c <= bucket.context and n <= bucket.num_seqs
            for s, c, n, k in self._infeasible
        )

    # ---- deciding -----------------------------------------------------------------------
    def select(self, stage: str, stats: Mapping[str, Any], current: Layout | None = None) -> Layout:
        """The layout for ``stage`` at this step; the full explanation is ``last_decisions[stage]``."""
        return self.decide(stage, stats, current).layout

    def decide(
        self, stage: str, stats: Mapping[str, Any], current: Layout | None = None
    ) -> Decision:
        check_stage(stage)
        if current is not None and not isinstance(current, Layout):
            raise ValueError(f"`current` must be a Layout or None, got {current!r}")
        bucket = bucket_of(stats)
        reports = {
            layout_key(c): self._assess(stage, c, stats, bucket, current)
            for c in self._candidates[stage]
        }
        usable = [k for k, r in reports.items() if r.usable]
        if not usable:
            raise self._no_fit_error(stage, stats, reports)
        incumbent = self._incumbent(stage, current, reports)
        key, reason = choose(stage, usable, incumbent, reports, self.hysteresis)
        dropped = [self._drop_note(r) for r in reports.values() if not r.usable]
        if dropped:
            reason += "; dropped " + ", ".join(dropped)
        layout = next(c for c in self._candidates[stage] if layout_key(c) == key)
        r = reports[key]
        decision = Decision(
            stage,
            layout,
            r.predicted_bytes,
            r.tokens_per_s,
            reason,
            bucket,
            current is not None and layout_key(current) != key,
            r.seconds,
            r.switch_s,
            tuple(reports.values()),
        )
        self._choices[stage] = layout
        self.last_decisions[stage] = decision
        return decision

    def estimate(self, stage: str, layout: Layout, stats: Mapping[str, Any]) -> MemoryEstimate:
        return self.memory_model.estimate(
            stage, layout, stats, train_layout=self._choices.get("train")
        )

    @property
    def usable_bytes(self) -> float:
        return self.budget_bytes * (1.0 - self.safety_margin)

    def _assess(
        self,
        stage: str,
        layout: Layout,
        stats: Mapping[str, Any],
        bucket: Bucket,
        current: Layout | None,
    ) -> CandidateReport:
        est = self.estimate(stage, layout, stats)
        tps = None
        if self.table is not None:
            tps = self.table.lookup(
                stage, layout, float(stats["context_mean"]), float(stats["num_seqs"])
            )
        seconds = work_tokens(stage, stats) / tps if tps else None
        switch = self.switch_cost(stage, current, layout) / self.amortize_steps
        return CandidateReport(
            layout_key(layout),
            est.total,
            est.total <= self.usable_bytes,
            self.is_infeasible(stage, bucket, layout),
            tps,
            seconds,
            switch,
        )

    def _incumbent(
        self, stage: str, current: Layout | None, reports: dict[str, CandidateReport]
    ) -> str | None:
        """The layout to keep unless another is clearly better: the stage's previous choice,
        else the layout the model is in now."""
        for lay in (self._choices.get(stage), current):
            if lay is not None and layout_key(lay) in reports:
                return layout_key(lay)
        return None

    def _drop_note(self, r: CandidateReport) -> str:
        if r.marked_infeasible:
            return f"{r.layout} (out of memory at this size before)"
        return f"{r.layout} (needs {gib(r.predicted_bytes)} > {gib(self.usable_bytes)})"

    def _no_fit_error(
        self, stage: str, stats: Mapping[str, Any], reports: dict[str, CandidateReport]
    ) -> NoFeasibleLayoutError:
        smallest = min(reports.values(), key=lambda r: r.predicted_bytes)
        est = self.estimate(
            stage,
            next(c for c in self._candidates[stage] if layout_key(c) == smallest.layout),
            stats,
        )
        marked = [r.layout for r in reports.values() if r.marked_infeasible]
        return NoFeasibleLayoutError(
            f"no candidate layout fits `budget_bytes`={self.budget_bytes} ({gib(self.budget_bytes)} per device, "
            f"{gib(self.usable_bytes)} after the {self.safety_margin:.0%} safety margin) for stage {stage!r} "
            f"with num_seqs={stats['num_seqs']}, context_max={stats['context_max']}: the smallest estimate is "
            f"{smallest.layout} at {gib(smallest.predicted_bytes)} [{est.summary()}]"
            + (f"; marked infeasible after an out-of-memory error: {marked}" if marked else "")
            + ". Raise `budget_bytes`, lower the micro-batch tokens, enable activation checkpointing, "
            "or add layouts with more parallelism."
        )

    # ---- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "table": self.table.to_dict() if self.table is not None else None,
            "infeasible": [list(m) for m in sorted(self._infeasible)],
            "choices": {s: asdict(lay) for s, lay in self._choices.items()},
            "switch_observed": {s: list(v) for s, v in self._observed.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"selector state must be a dict with version {STATE_VERSION}, got "
                f"{state.get('version') if isinstance(state, Mapping) else type(state).__name__!r}"
            )
        table = state.get("table")
        self.set_table(
            ProfileTable.from_dict(table, "the selector state's profile table") if table else None
        )
        choices = {}
        for stage, d in state.get("choices", {}).items():
            lay = Layout(**d)
            if layout_key(lay) not in {layout_key(c) for c in self.candidates(stage)}:
                raise ValueError(
                    f"selector state chose {layout_key(lay)} for stage {stage!r}, which is not among "
                    f"the candidates {[layout_key(c) for c in self._candidates[stage]]}"
                )
            choices[stage] = lay
        self._choices = choices
        self._infeasible = {
            (str(s), int(c), int(n), str(k)) for s, c, n, k in state.get("infeasible", [])
        }
        self._observed = {
            s: (int(v[0]), float(v[1])) for s, v in state.get("switch_observed", {}).items()
        }

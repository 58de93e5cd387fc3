"""The plan of a run: for every context length of a schedule, the layout, micro-batch and
activation checkpointing the selector would choose per stage, its predicted peak memory per device
and stage time, and the same figures for every static layout.

One model, not a copy: the memory model is the one ``AdaptiveParallelism`` builds
(:func:`~earl_lightning.callbacks.adaptive_setup.memory_model_of`), the candidates are its
(:func:`~earl_lightning.callbacks.adaptive_setup.stage_candidates`), and the choice is the
:class:`~earl_lightning.parallel.selector.Selector`'s, reading a throughput table that the
:class:`~earl_lightning.parallel.timing.TimeModel` fills instead of a measured profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from earl_lightning.callbacks.adaptive_setup import memory_model_of, stage_candidates
from earl_lightning.parallel.hardware import Cluster
from earl_lightning.parallel.layout import STAGES, Layout
from earl_lightning.parallel.memory import MemoryModel
from earl_lightning.parallel.selector import NoFeasibleLayoutError, Selector
from earl_lightning.parallel.throughput import work_tokens
from earl_lightning.parallel.timing import TimeModel
from earl_lightning.planning.inputs import Recipe

CHECKPOINTING = [False, True]  # the train stage may recompute activations (chosen per step)


@dataclass(frozen=True)
class PlanSettings:
    """What a plan is for: the model's config, its dtype, the cluster, the recipe, the context
    lengths in the order training reaches them and the sequences per step."""

    config: Any
    dtype: str
    cluster: Cluster
    recipe: Recipe
    contexts: list[int]
    num_seqs: int
    model_name: str = "model"
    train_placement: tuple[int, int] | None = None  # (dp, tp); None: the plan picks one


@dataclass
class _Strategy:
    """What :func:`stage_candidates` reads from EarlStrategy."""

    world_size: int
    train_layout: Layout
    listed_layouts: list[Layout] | None = None


@dataclass
class PlanResult:
    """Rows of the plan: ``adaptive`` (one per context and stage), ``static`` (one per policy,
    context and stage), the train placement and the usable memory per device."""

    settings: PlanSettings
    train_placement: tuple[int, int]
    usable_bytes: float
    budget_bytes: int
    adaptive: list[dict[str, Any]] = field(default_factory=list)
    static: list[dict[str, Any]] = field(default_factory=list)


def step_stats(settings: PlanSettings, context: int) -> dict[str, float]:
    """The statistics the selector sees at a step whose rows are ``context`` tokens long: every
    row that long, ``max_turns`` turns of ``max_new_tokens`` generated tokens each (the scored
    positions), each turn's new tokens an equal share of the row."""
    r = settings.recipe
    turns = turns_at(r, context)
    generated = min(turns * r.max_new_tokens, context - 1)
    return {
        "num_seqs": settings.num_seqs,
        "context_mean": context,
        "context_max": context,
        "context_p95": context,
        "gen_len": r.max_new_tokens,
        "prompt_max": math.ceil(context / turns),
        "turn_prefill_max": math.ceil(context / turns) if turns > 1 else 0,
        "scored_max": generated,
        "scored_share_max": generated / context,
    }


def turns_at(recipe: Recipe, context: int) -> int:
    """Turns of an episode whose row is ``context`` tokens: the recipe's, fewer where its turns
    would not leave a prompt token each."""
    return max(1, min(recipe.max_turns, context // (recipe.max_new_tokens + 1)))


def models_for(settings: PlanSettings) -> tuple[MemoryModel, TimeModel]:
    r, cluster = settings.recipe, settings.cluster
    memory = memory_model_of(
        settings.config,
        settings.dtype,
        "adamw",
        r.workload,
        resident_train_state=cluster.device.kind == "gpu",
    )
    time = TimeModel(
        memory,
        cluster,
        turns=r.max_turns,
        ppo_epochs=r.ppo_epochs,
        optimizer_steps=r.ppo_epochs * r.mini_batches,
        experience_forwards=r.experience_forwards,
    )
    return memory, time


def make_plan(settings: PlanSettings) -> PlanResult:
    """The adaptive choice at every context, every static layout beside it."""
    memory, _ = models_for(settings)
    world = settings.cluster.world_size
    placements = Layout.factorizations(world, memory.sizes.num_heads, memory.sizes.num_kv_heads)
    if settings.train_placement is not None:
        dp, tp = settings.train_placement
        train = Layout(dp, tp, settings.recipe.workload.micro_batch_tokens)
    else:
        train = _pick_train_placement(settings, placements)
    selector = _selector(settings, train)
    return PlanResult(
        settings,
        (train.dp, train.tp),
        selector.usable_bytes,
        selector.budget_bytes,
        adaptive=_adaptive_rows(settings, selector),
        static=_static_rows(settings, selector),
    )


def _selector(settings: PlanSettings, train: Layout, *, all_train: bool = False) -> Selector:
    """The selector ``earl fit`` builds for this run (``all_train``: every placement is a train
    candidate, to pick the train placement)."""
    memory, time = models_for(settings)
    work = settings.recipe.workload
    strategy = _Strategy(settings.cluster.world_size, train)
    per_stage = stage_candidates(strategy, memory, work, "auto", None, CHECKPOINTING)
    if all_train:
        per_stage["train"] = [
            Layout(p.dp, p.tp, lay.micro_batch_tokens, lay.activation_checkpointing)
            for p in Layout.factorizations(
                strategy.world_size, memory.sizes.num_heads, memory.sizes.num_kv_heads
            )
            for lay in per_stage["train"]
        ]
    stats = [step_stats(settings, c) for c in settings.contexts]
    table = time.table(per_stage, stats, settings.model_name)
    return Selector(per_stage, memory, table, settings.cluster.device.memory_bytes)


def _pick_train_placement(settings: PlanSettings, placements: list[Layout]) -> Layout:
    """The train placement of the run (fixed for it: the optimizer's state lives there): the one
    whose best micro-batch and checkpointing fit the most contexts, then the fastest in total."""
    selector = _selector(settings, placements[0], all_train=True)
    best, best_key = placements[0], None
    for p in placements:
        mine = [c for c in selector.candidates("train") if (c.dp, c.tp) == (p.dp, p.tp)]
        fits, total = 0, 0.0
        for context in settings.contexts:
            s = step_stats(settings, context)
            usable = [
                c for c in mine if selector.estimate("train", c, s).total <= selector.usable_bytes
            ]
            if usable:
                fits += 1
                total += min(_seconds(selector, "train", c, s) for c in usable)
        key = (-fits, total)
        if best_key is None or key < best_key:
            best, best_key = p, key
    return Layout(best.dp, best.tp, settings.recipe.workload.micro_batch_tokens)


def _seconds(selector: Selector, stage: str, layout: Layout, stats: dict[str, float]) -> float:
    tps = selector.table.lookup(stage, layout, stats["context_mean"], stats["num_seqs"])
    return max(work_tokens(stage, stats), 1.0) / tps


def _adaptive_rows(settings: PlanSettings, selector: Selector) -> list[dict[str, Any]]:
    """The selector's decisions as the contexts grow, each stage starting from its previous choice
    (its hysteresis applies as in a run)."""
    rows, current = [], dict.fromkeys(STAGES)
    for context in settings.contexts:
        s = step_stats(settings, context)
        for stage in STAGES:
            try:
                d = selector.decide(stage, s, current[stage])
            except NoFeasibleLayoutError as err:
                smallest = min(
                    selector.candidates(stage), key=lambda c: selector.estimate(stage, c, s).total
                )
                rows.append(
                    _row(context, stage, smallest, selector, s, fits=False, reason=str(err))
                )
                continue
            current[stage] = d.layout
            rows.append(_row(context, stage, d.layout, selector, s, fits=True, reason=d.reason))
    return rows


def _static_rows(settings: PlanSettings, selector: Selector) -> list[dict[str, Any]]:
    """Every static policy the selector chooses among: one placement for rollout and experience,
    one micro-batch budget for every stage and checkpointing on or off for train (whose placement
    is the run's)."""
    train = selector.candidates("train")[0]
    rows = []
    for place in selector.candidates("rollout"):
        for ckpt in CHECKPOINTING:
            policy = full_name(Layout(place.dp, place.tp, place.micro_batch_tokens, ckpt))
            layouts = {
                "rollout": place,
                "experience": place,
                "train": Layout(train.dp, train.tp, place.micro_batch_tokens, ckpt),
            }
            for context in settings.contexts:
                s = step_stats(settings, context)
                for stage in STAGES:
                    row = _row(context, stage, layouts[stage], selector, s, fits=None, reason="")
                    rows.append({"policy": policy, **row})
    return rows


def full_name(layout: Layout) -> str:
    """``dp32xtp4-mbt8192-ckpt``: every knob spelled out (a profile key omits the defaults)."""
    ckpt = "-ckpt" if layout.activation_checkpointing else ""
    return f"{layout.name}-mbt{layout.micro_batch_tokens}{ckpt}"


def _row(
    context: int,
    stage: str,
    layout: Layout,
    selector: Selector,
    stats: dict[str, float],
    *,
    fits: bool | None,
    reason: str,
) -> dict[str, Any]:
    peak = selector.estimate(stage, layout, stats).total
    ok = peak <= selector.usable_bytes if fits is None else fits
    return {
        "context": context,
        "stage": stage,
        "layout": full_name(layout),
        "dp": layout.dp,
        "tp": layout.tp,
        "micro_batch_tokens": layout.micro_batch_tokens,
        "activation_checkpointing": layout.activation_checkpointing,
        "peak_bytes": peak,
        "peak_gib": peak / 2**30,
        "fits": ok,
        "seconds": _seconds(selector, stage, layout, stats),
        "reason": reason,
    }

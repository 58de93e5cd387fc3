"""What :class:`~earl_lightning.callbacks.adaptive.AdaptiveParallelism` reads to build its selector:
its arguments (checked once, at construction), the module's declared workload and policy, the
optimizer's name, the memory budget per device, each stage's candidate layouts, and a throughput
profile measured at fit start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

from earl_lightning.callbacks.base import WorkloadSource
from earl_lightning.core.checks import check_number, is_int
from earl_lightning.parallel.layout import STAGES, Layout
from earl_lightning.parallel.memory import OPTIMIZER_STATES, MemoryModel, Workload
from earl_lightning.parallel.throughput import ProfileTable, layout_key
from earl_lightning.train.scored import MAX_SCORED_SHARE

GIB = 2**30


def check_arguments(
    profile, profile_budget_s, memory_budget_gb, memory_budget_bytes, micro_batch_tokens
) -> None:
    """The profile, budget and micro-batch arguments, each error naming the argument."""
    if profile is not None and profile_budget_s is not None:
        raise ValueError(
            "give either `profile` (a saved table) or `profile_budget_s` (measure one at fit start), "
            f"not both; got profile={profile!r}, profile_budget_s={profile_budget_s!r}"
        )
    if profile is not None and not isinstance(profile, (str, os.PathLike)):
        raise ValueError(f"`profile` must be a path to a profile JSON file, got {profile!r}")
    positive = dict(low=0, strict=True, optional=True)
    check_number("profile_budget_s", profile_budget_s, **positive, unit=" of seconds")
    if memory_budget_gb is not None and memory_budget_bytes is not None:
        raise ValueError(
            "give the memory budget once: `memory_budget_gb` or `memory_budget_bytes`, not both"
        )
    check_number("memory_budget_gb", memory_budget_gb, **positive, unit=" of GiB per device")
    per_device = " of bytes per device"
    check_number("memory_budget_bytes", memory_budget_bytes, **positive, unit=per_device)
    if micro_batch_tokens is not None and (
        isinstance(micro_batch_tokens, (str, bytes))
        or not isinstance(micro_batch_tokens, Sequence)
        or not micro_batch_tokens
        or not all(is_int(m) and m >= 1 for m in micro_batch_tokens)
    ):
        raise ValueError(
            f"`micro_batch_tokens` must be a non-empty list of positive integers, "
            f"got {micro_batch_tokens!r}"
        )


def checkpointing_choices(activation_checkpointing: Any) -> list[bool] | None:
    """The train stage's recomputation choices, sorted (None: the train layout's own setting)."""
    if activation_checkpointing is not None and (
        isinstance(activation_checkpointing, (str, bytes))
        or not isinstance(activation_checkpointing, Sequence)
        or not activation_checkpointing
        or any(not isinstance(a, bool) for a in activation_checkpointing)
    ):
        raise ValueError(
            f"`activation_checkpointing` must be a non-empty list of booleans such as [False, True], "
            f"got {activation_checkpointing!r}"
        )
    return None if activation_checkpointing is None else sorted(set(activation_checkpointing))


def candidate_layouts(candidates: Any) -> Any:
    """``"auto"``, or the listed candidates as layouts (each error names ``candidates[i]``)."""
    if candidates == "auto":
        return candidates
    if (
        isinstance(candidates, (str, bytes))
        or not isinstance(candidates, Sequence)
        or not candidates
    ):
        raise ValueError(
            f"`candidates` must be 'auto' or a non-empty list of layouts, got {candidates!r}"
        )
    return [_to_layout(c, f"candidates[{i}]") for i, c in enumerate(candidates)]


def _to_layout(value: Any, arg: str) -> Layout:
    return Layout.coerce(dict(value) if isinstance(value, Mapping) else value, arg)


def workload_of(pl_module: L.LightningModule) -> Workload:
    """The module's declared workload (what sizes the memory model)."""
    if not isinstance(pl_module, WorkloadSource):
        raise ValueError(
            f"AdaptiveParallelism sizes layouts from the module's declared `workload` and "
            f"`tokenizer` (AgenticRLModule has both); {type(pl_module).__name__} lacks them"
        )
    return pl_module.workload


def policy_of(pl_module: L.LightningModule, strategy: Any) -> torch.nn.Module:
    """The first HF model among the strategy's ``model_attrs`` on the module."""
    from transformers import PreTrainedModel

    for attr in strategy.model_attrs:
        model = getattr(pl_module, attr, None)
        if isinstance(model, PreTrainedModel):
            return model
    raise ValueError(
        f"AdaptiveParallelism sizes layouts from the module's HF model; none of the strategy's "
        f"`model_attrs` {list(strategy.model_attrs)} holds one on {type(pl_module).__name__}"
    )


def memory_model_of(
    config: Any, dtype: str, optimizer: str, work: Workload, *, resident_train_state: bool
) -> MemoryModel:
    """The memory model a run's layouts are sized with, from the policy's config and the module's
    declared workload: the one ``AdaptiveParallelism`` builds and ``earl plan`` reads.
    ``resident_train_state``: the train copy's shards and optimizer state stay on the device
    during rollout and experience (on a GPU they do; on a CPU everything is host memory and a
    stage's budget is what it adds)."""
    return MemoryModel(
        config,
        dtype,
        optimizer,
        rollout_backend=work.backend,
        reference_model=work.reference_model,
        reuse_kv=work.reuse_kv,
        scored_share_limit=MAX_SCORED_SHARE if work.scored_last_layer else None,
        resident_train_state=resident_train_state,
    )


def optimizer_name(trainer: L.Trainer) -> str:
    """The memory model's name of the trainer's optimizer ("adamw" when unknown)."""
    opts = trainer.optimizers
    name = type(opts[0]).__name__.lower() if opts else "adamw"
    return name if name in OPTIMIZER_STATES else "adamw"  # unknown: assume Adam-like states


def budget_bytes(
    trainer: L.Trainer, memory_budget_bytes: int | None, memory_budget_gb: float | None
) -> int:
    """The memory per device the layouts must fit: the callback's budget, else the strategy's,
    else the GPU's total memory or the host's RAM divided by the processes on the node."""
    if memory_budget_bytes is not None:
        return int(memory_budget_bytes)
    gb = memory_budget_gb or trainer.strategy.memory_budget_gb
    if gb:
        return int(gb * GIB)
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    per_node = max(1, trainer.world_size // max(1, trainer.num_nodes))
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_node)


def _mbt_options(micro_batch_tokens: list[int] | None, work: Workload) -> list[int]:
    if micro_batch_tokens is not None:
        return sorted(set(micro_batch_tokens), reverse=True)
    base = int(work.micro_batch_tokens)
    return sorted({max(1, base // f) for f in (1, 2, 4)}, reverse=True)


def stage_candidates(
    strategy: Any,
    memory: MemoryModel,
    work: Workload,
    candidates: Any,
    micro_batch_tokens: list[int] | None,
    activation_checkpointing: list[bool] | None,
) -> dict[str, list[Layout]]:
    """Each stage's candidate layouts: rollout and experience every placement with every
    micro-batch budget; train the strategy's train placement with every budget and choice of
    recomputation."""
    z, world = memory.sizes, strategy.world_size
    if candidates == "auto":
        places = Layout.factorizations(world, z.num_heads, z.num_kv_heads)
        allowed = strategy.listed_layouts  # an explicit strategy list narrows "auto"
        if allowed:
            places = [p for p in places if any((a.dp, a.tp) == (p.dp, p.tp) for a in allowed)]
    else:
        places = candidates
    mbts = _mbt_options(micro_batch_tokens, work)
    knobs = lambda p: [Layout(p.dp, p.tp, m, p.activation_checkpointing) for m in mbts]  # noqa: E731
    unique = list({(p.dp, p.tp, p.activation_checkpointing): p for p in places}.values())
    inference = [lay for p in unique for lay in knobs(p)]
    train = strategy.train_layout
    ckpts = activation_checkpointing or [train.activation_checkpointing]
    train_options = [Layout(train.dp, train.tp, m, a) for a in ckpts for m in mbts]
    return {"rollout": inference, "experience": inference, "train": train_options}


def profile_at_fit_start(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    model: torch.nn.Module,
    per_stage: dict[str, list[Layout]],
    work: Workload,
    *,
    default_context: float,
    contexts: list[int] | None,
    budget_s: float | None,
    out_dir: str | None,
) -> ProfileTable:
    """Measure every candidate's throughput within ``budget_s``; saved under ``out_dir`` (relative:
    under the Trainer's ``default_root_dir``) by rank 0 when given."""
    from transformers import AutoModelForCausalLM

    from earl_lightning.profiling.profiler import ProfileGrid, profile_stages

    layouts = list({layout_key(c): c for s in STAGES for c in per_stage[s]}.values())
    top = int(default_context) if default_context > 1 else 4096
    contexts = contexts or [c for c in (256, 1024, 4096, 16384, 65536) if c <= max(top, 256)]
    grid = ProfileGrid(
        contexts=contexts, num_seqs=[_batch_size(trainer)], gen_len=int(work.max_new_tokens)
    )
    dtype, config = next(model.parameters()).dtype, model.config
    run = profile_stages(
        lambda: AutoModelForCausalLM.from_config(config).to(dtype),
        pl_module.tokenizer,
        layouts=layouts,
        grid=grid,
        model_name=getattr(config, "_name_or_path", "") or "model",
        budget_s=budget_s,
        device=trainer.strategy.root_device,
        scored_last_layer=work.scored_last_layer,
    )
    if out_dir and trainer.global_rank == 0:
        out = Path(out_dir)
        out = out if out.is_absolute() else Path(trainer.default_root_dir) / out
        run.table.save(out / "profile.json")
        run.table.heatmaps(out)
    return run.table


def _batch_size(trainer: L.Trainer) -> int:
    """Episodes per RL step of the trainer's EpisodeDataModule (8 without one)."""
    from earl_lightning.modules.datamodule import EpisodeDataModule

    dm = trainer.datamodule
    return int(dm.batch_size) if isinstance(dm, EpisodeDataModule) else 8

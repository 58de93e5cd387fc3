"""``earl profile --config <recipe>``: measure each RL stage's tokens/s per context length x number
of sequences x layout for a recipe's model (:mod:`earl_lightning.profiling.profiler`), for
``AdaptiveParallelism(profile=...)``.

The recipe is read the way ``earl fit`` reads it: its ``model:`` and ``data:`` sections build the
LightningModule and the DataModule (so every setting is validated, and the profile uses the
typed configuration's values). On one process only ``dp1xtp1`` is measured: launch under
``torchrun --nproc-per-node N`` to profile every dp x tp factorization of N.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from earl_lightning.core import console
from earl_lightning.parallel.collectives import global_rank, world_size
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import model_heads
from earl_lightning.profiling.profiler import ProfileGrid, ProfileRun, profile_stages


def read_recipe(config: str) -> tuple[Any, Any]:
    """The recipe's (AgenticRLModule, EpisodeDataModule), built from its sections."""
    from omegaconf import OmegaConf

    from earl_lightning.modules.datamodule import EpisodeDataModule
    from earl_lightning.modules.rl import AgenticRLModule

    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"`--config` {config!r} is not a file")
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    except Exception as err:  # noqa: BLE001 - YAML and interpolation errors alike
        raise ValueError(f"`--config` {config!r} is not a readable recipe: {err}") from None
    return AgenticRLModule(**(cfg.get("model") or {})), EpisodeDataModule(**(cfg.get("data") or {}))


def _init_world() -> torch.device:
    """Join the processes ``torchrun`` started (if any); the device this rank measures on."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def profile_recipe(
    config: str,
    *,
    out: str | None = None,
    budget_s: float = 600.0,
    contexts: Sequence[int] | None = None,
    num_seqs: Sequence[int] | None = None,
    repeats: int = 3,
    log: Callable[[str], None] | None = None,
) -> ProfileRun:
    """Profile a recipe's model on the world this process runs in; save JSON + heatmaps under ``out``."""
    from earl_lightning.models import load_model

    module, data = read_recipe(config)
    work, name = module.workload, str(module.hparams.model)
    device = _init_world()
    if contexts is None:
        contexts = [
            c
            for c in (256, 1024, 4096, 16384, 65536, 262144)
            if c <= max(256, work.max_context_tokens)
        ]
    grid = ProfileGrid(
        contexts=list(contexts),
        num_seqs=list(num_seqs or [data.batch_size]),
        gen_len=work.max_new_tokens,
        repeats=repeats,
    )
    base = load_model(name, module.hparams.dtype, "model.model")
    factory = lambda: copy.deepcopy(base)  # noqa: E731 - the same weights on every call and rank
    heads, kv = model_heads(base)
    layouts = Layout.factorizations(
        world_size(), heads, kv, micro_batch_tokens=work.micro_batch_tokens
    )
    # The train stage is also measured with activation checkpointing (AdaptiveParallelism's
    # `activation_checkpointing=[False, True]` chooses between them); the others skip those.
    layouts += [replace(lay, activation_checkpointing=True) for lay in layouts]
    run = profile_stages(
        factory,
        module.tokenizer,
        layouts=layouts,
        grid=grid,
        model_name=name,
        budget_s=budget_s,
        device=device,
        scored_last_layer=module.optim_config.scored_last_layer,
        log=log,
    )
    target = Path(out or Path("profiles") / Path(config).stem)
    if global_rank() == 0:
        path = run.table.save(target / "profile.json")
        pngs = run.table.heatmaps(target)
        if log is not None:
            log(
                f"measured {run.measured} cells in {run.seconds:.0f}s ({len(run.skipped)} skipped by the budget); "
                f"wrote {path} and {', '.join(str(p) for p in pngs)}"
            )
    return run


def profile_parser() -> argparse.ArgumentParser:
    """``earl profile``'s arguments (the README's command is parsed by it in a test)."""
    parser = argparse.ArgumentParser(
        prog="earl profile",
        description=(
            "Measure each RL stage's tokens/s per context length x number of sequences x layout for a recipe's "
            "model; writes profile.json and one heatmap PNG per stage. On one process only dp1xtp1 is measured: "
            "launch under `torchrun --nproc-per-node N` to profile every dp x tp of N."
        ),
    )
    parser.add_argument(
        "--config", required=True, help="the recipe YAML (its model and data sections are used)"
    )
    parser.add_argument(
        "--out", default=None, help="output directory (default: profiles/<recipe name>)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=600.0, help="stop measuring after this many seconds"
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=None,
        help="context lengths (default: powers of 4 from 256 to model.rollout.max_context_tokens)",
    )
    parser.add_argument(
        "--num-seqs",
        type=int,
        nargs="+",
        default=None,
        help="sequences per step (default: data.batch_size)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per cell; the median counts"
    )
    return parser


def profile_command(argv: list[str]) -> None:
    """``earl profile``: argument parsing, then :func:`profile_recipe`; errors as one line."""
    ns = profile_parser().parse_args(argv)
    try:
        profile_recipe(
            ns.config,
            out=ns.out,
            budget_s=ns.budget_s,
            contexts=ns.contexts,
            num_seqs=ns.num_seqs,
            repeats=ns.repeats,
            log=print,
        )
    except (ValueError, FileNotFoundError) as err:
        console.error(f"earl profile: error: {err}")
        raise SystemExit(2) from None

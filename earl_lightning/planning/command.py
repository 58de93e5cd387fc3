"""``earl plan``: what the layout selector would choose for a real model on a real cluster, before
renting it.

    earl plan --model benchmarks/configs/qwen2.5-72b-instruct.json --cluster 16x8xH100-80G \\
        --recipe recipes/connect4_ppo.yaml --contexts 1024:32768 --dtype bfloat16 --out plans/72b

Reads the model's config only (a ``config.json``, a model directory, a preset or a cached hub id:
no weights), the recipe's typed settings, and a device profile; prints per context and stage the
layout, micro-batch and checkpointing the selector would choose with its predicted peak memory
per device and stage time, and where every static layout runs out of memory; writes them as
CSV and a PNG. Bad input is one line, ``earl: error: ...``, exit status 2.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from earl_lightning.core import console
from earl_lightning.parallel.hardware import Cluster, device_names
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.memory import DTYPE_BYTES
from earl_lightning.parallel.model_sizes import ModelSizes
from earl_lightning.planning.inputs import parse_contexts, read_model_config, read_recipe
from earl_lightning.planning.plan import PlanSettings, make_plan
from earl_lightning.planning.report import format_tables, write_all

_PLACEMENT = re.compile(r"^dp(\d+)xtp(\d+)$")


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="earl plan",
        description="Predict per context length and RL stage the layout the selector would choose, "
        "its peak memory per device and stage time, and where every static layout runs out of "
        "memory, for a model config on a cluster. No weights are read; nothing runs on a device.",
    )
    p.add_argument(
        "--cluster", required=True, help=f"NODESxPER_NODExDEVICE; devices: {device_names()}"
    )
    p.add_argument("--recipe", required=True, help="a recipe YAML (its model and data sections)")
    p.add_argument(
        "--model",
        default=None,
        help="a config.json, a model directory, a preset or a cached hub id (default: the recipe's model)",
    )
    p.add_argument(
        "--contexts",
        default=None,
        help="row lengths in the order training reaches them: A:B (doubling from A to B) or a comma "
        "list (default: 1024:<the recipe's rollout.max_context_tokens>)",
    )
    p.add_argument(
        "--num-seqs", type=int, default=None, help="sequences per step (default: data.batch_size)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help=f"one of {sorted(DTYPE_BYTES)} (default: the recipe's model.dtype)",
    )
    p.add_argument(
        "--train-layout",
        default=None,
        help="the train placement, e.g. dp16xtp8 (default: the plan picks it)",
    )
    p.add_argument(
        "--out", default=None, help="output directory (default: plans/<recipe>_<cluster>)"
    )
    return p


def settings_from(ns: argparse.Namespace) -> PlanSettings:
    """The plan's inputs from the parsed flags; every problem a one-line ValueError naming its flag."""
    cluster = Cluster.parse(ns.cluster, "--cluster")
    recipe = read_recipe(ns.recipe, "--recipe")
    model = ns.model or recipe.model
    config = read_model_config(model, "--model" if ns.model else "--recipe's model.model")
    default_top = max(2, recipe.workload.max_context_tokens)
    contexts = parse_contexts(
        ns.contexts or f"{min(1024, default_top)}:{default_top}", "--contexts"
    )
    dtype = ns.dtype or recipe.dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"`--dtype` must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    cluster.device.flops(dtype)  # a device without a rate for the dtype: one line now
    num_seqs = recipe.batch_size if ns.num_seqs is None else ns.num_seqs
    if num_seqs < 1:
        raise ValueError(f"`--num-seqs` must be a positive integer, got {num_seqs}")
    sizes = ModelSizes.from_config(config)
    return PlanSettings(
        config,
        dtype,
        cluster,
        recipe,
        contexts,
        num_seqs,
        model_name=Path(model).stem if model.endswith(".json") else model,
        train_placement=_placement(ns.train_layout, cluster.world_size, sizes),
    )


def _placement(text: str | None, world: int, sizes: ModelSizes) -> tuple[int, int] | None:
    if text is None:
        return None
    m = _PLACEMENT.match(text)
    if m is None:
        raise ValueError(f"`--train-layout` must look like dp16xtp8, got {text!r}")
    lay = Layout(int(m[1]), int(m[2]))
    lay.check_world(world, arg="--train-layout").check_heads(
        sizes.num_heads, sizes.num_kv_heads, arg="--train-layout"
    )
    return lay.dp, lay.tp


def plan_command(argv: list[str]) -> None:
    """``earl plan``: parse, plan, print, write; bad input as one line with exit status 2."""
    ns = plan_parser().parse_args(argv)
    try:
        settings = settings_from(ns)
        result = make_plan(settings)
    except ValueError as err:
        console.error(f"earl: error: {err}")
        raise SystemExit(2) from None
    print(format_tables(result))
    out = Path(ns.out or Path("plans") / f"{Path(ns.recipe).stem}_{settings.cluster.name}")
    paths = write_all(result, out)
    print("\nwrote " + ", ".join(str(p) for p in paths))

"""What ``earl plan`` reads: a model's config (never its weights), a recipe's typed settings and
the context lengths to plan for. Every error is one line naming the flag as the user wrote it."""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from earl_lightning.core.config_groups import coerce
from earl_lightning.parallel.memory import DTYPE_BYTES, Workload
from earl_lightning.parallel.model_sizes import ModelSizes

# The config.json fields the memory and time models read (other names a config class maps onto
# them, such as GPT-2's n_layer, count too).
NEEDED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)


def read_model_config(model: str, arg: str = "--model") -> Any:
    """A transformers config from a ``config.json`` file, a model directory, an offline preset or
    a hub id whose config is in the local cache (nothing is downloaded, no weight is read)."""
    from transformers import AutoConfig

    from earl_lightning.models.loading import resolve_model_path
    from earl_lightning.models.tiny import PRESETS

    path = Path(os.path.expanduser(model))
    if model in PRESETS:
        path = Path(resolve_model_path(model, arg))
    if path.is_dir():
        path = path / "config.json"
    local = path.is_file() or path.suffix == ".json" or model.startswith((".", "/", "~"))
    if local and not path.is_file():
        raise ValueError(f"`{arg}` {model!r}: no such config file ({path})")
    if local:
        return _config_from_file(path, model, arg)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        raise ValueError(
            f"`{arg}` {model!r}: not a config.json, a model directory or a preset, and no config "
            f"of that hub id is cached here; give the path of its config.json"
        ) from None


def _config_from_file(path: Path, model: str, arg: str) -> Any:
    from transformers import AutoConfig

    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"`{arg}` {model!r}: {path} is not readable JSON ({err})") from None
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise ValueError(
            f"`{arg}` {model!r}: {path} has no `model_type`; a transformers config.json names its "
            f'architecture (e.g. "model_type": "qwen2")'
        )
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"`{arg}` {model!r}: transformers cannot read {path}: {first}") from None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    aliases = getattr(type(config.get_text_config()), "attribute_map", {}) or {}
    missing = [
        n
        for n in NEEDED_FIELDS
        if n not in text
        and not any(aliases.get(k) == n for k in text)
        and not (n == "intermediate_size" and "n_inner" in text)
    ]
    if missing:
        raise ValueError(
            f"`{arg}` {model!r}: {path} lacks {missing}; the plan sizes a decoder-only LM from "
            f"{list(NEEDED_FIELDS)} (defaults of the config class would be a guess)"
        )
    try:
        ModelSizes.from_config(config)
    except ValueError as err:
        raise ValueError(f"`{arg}` {model!r}: {err}") from None
    return config


@dataclass(frozen=True)
class Recipe:
    """The settings of a recipe the plan needs, read through the same typed groups as ``earl fit``."""

    path: str
    model: str
    dtype: str
    workload: Workload
    batch_size: int
    max_turns: int
    max_new_tokens: int
    ppo_epochs: int
    mini_batches: int
    scored_last_layer: bool
    experience_forwards: int  # the policy's unless exactly on-policy, plus a KL reference's


def read_recipe(recipe: str, arg: str = "--recipe") -> Recipe:
    """A recipe's rollout, algorithm and optimizer groups and its batch size, each checked as
    ``earl fit`` checks them."""
    from omegaconf import OmegaConf

    from earl_lightning.modules.config import (
        AlgorithmConfig,
        OptimConfig,
        RolloutConfig,
        check_combination,
    )
    from earl_lightning.modules.datamodule import EpisodeDataModule
    from earl_lightning.modules.views import exactly_on_policy, workload_view

    path = Path(recipe)
    if not path.is_file():
        raise ValueError(f"`{arg}` {recipe!r} is not a file")
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    except Exception as err:  # noqa: BLE001 - YAML and interpolation errors alike
        raise ValueError(f"`{arg}` {recipe!r} is not a readable recipe: {err}") from None
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    rollout = coerce(RolloutConfig, model.get("rollout"), "--model.rollout")
    algorithm = coerce(AlgorithmConfig, model.get("algorithm"), "--model.algorithm")
    optim = coerce(OptimConfig, model.get("optim"), "--model.optim")
    check_combination(rollout, algorithm)
    defaults = inspect.signature(EpisodeDataModule).parameters
    batch = data.get("batch_size", defaults["batch_size"].default)
    work = workload_view(
        rollout,
        algorithm,
        optim,
        lora=model.get("peft") is not None,
        scored_last_layer=optim.scored_last_layer,
    )
    dtype = model.get("dtype", "float32")
    if dtype not in DTYPE_BYTES:
        raise ValueError(
            f"`{arg}`: model.dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}"
        )
    return Recipe(
        str(path),
        str(model.get("model", "earl-tiny")),
        dtype,
        work,
        int(batch),
        rollout.max_turns,
        rollout.sampling.max_new_tokens,
        optim.ppo_epochs,
        optim.mini_batches,
        optim.scored_last_layer,
        int(not exactly_on_policy(rollout, algorithm, optim)) + int(algorithm.kl.coef > 0),
    )


def parse_contexts(text: str, arg: str = "--contexts") -> list[int]:
    """``A:B`` (A, 2A, 4A, ... up to B, B included) or ``A,B,C`` (increasing) token counts >= 2."""
    bad = ValueError(
        f"`{arg}` must be A:B (doubling from A up to B) or a comma list such as 1024,4096,32768, "
        f"of increasing lengths of at least 2 tokens; got {text!r}"
    )
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            out = [lo]
            while lo >= 2 and out[-1] * 2 < hi:
                out.append(out[-1] * 2)
            if hi > lo:
                out.append(hi)
            elif hi < lo:
                raise bad
        else:
            out = [int(x) for x in text.split(",")]
    except ValueError:
        raise bad from None
    if min(out) < 2 or any(b <= a for a, b in zip(out, out[1:])):
        raise bad
    return out

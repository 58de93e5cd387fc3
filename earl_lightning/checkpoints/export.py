"""The trained model to take away: a ``save_pretrained`` directory that ``transformers`` and vLLM
load as they load a hub model.

Two ways in, one writer (:func:`write_pretrained`): the :class:`~earl_lightning.callbacks.ExportModel`
callback at the end of ``earl fit`` (the policy as trained, gathered from its shards), and
``earl export --ckpt_path <checkpoint> --out <dir>`` (:func:`export_checkpoint`) for any checkpoint
a fit wrote: a Lightning ``.ckpt`` file, or the distributed (DCP) directory EarlStrategy writes on
several processes. The model is rebuilt from the checkpoint's own hyperparameters (the model path
or preset it was trained from, which also gives the tokenizer and its chat template).

A policy trained with LoRA adapters (``--model.peft``) is written merged, ``W + B @ A * scale``
under the base names: plain transformers weights that load without peft.

The directory holds the model's weights (safetensors) and ``config.json``, its
``generation_config.json`` and the tokenizer files with the chat template. It is written into a
temporary sibling and renamed into place: a crash never leaves half a directory under its name.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from earl_lightning.checkpoints.files import (
    check_checkpoint_matches,
    inside_problem,
    is_dcp_dir,
    output_dir_problem,
    overlap_problem,
    read_dcp_shapes,
    write_dir_atomically,
)
from earl_lightning.checkpoints.loaders import checkpoint_unreadable, load_dcp
from earl_lightning.checkpoints.urls import local_checkpoint
from earl_lightning.core import console
from earl_lightning.core.config_groups import coerce
from earl_lightning.core.errors import CheckpointError, EarlError
from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.models.lora import LoraSettings, apply_lora, merge_plan, merged_tensors
from earl_lightning.rollout.weight_sync import full_tensor, hf_parameter_name

EXPORT_DIRNAME = "hf_model"
POLICY_PREFIX = "policy."  # where AgenticRLModule (and WarmStartModule) keep the causal LM


# ---- writing ------------------------------------------------------------------------------------


def gather_state_dict(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """``model``'s state dict as whole CPU tensors under the HF names where ``keep`` is true (None
    elsewhere). Sharded (FSDP2 / tensor-parallel DTensor) entries are all-gathered, a
    collective: every rank calls this and walks the same order. Tied weights stay one tensor;
    LoRA layers are merged into plain weights."""
    out: dict[str, torch.Tensor] = {}
    whole: dict[int, torch.Tensor] = {}
    # the parameters themselves: tied ones are one object
    entries = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in entries.items():
            if id(value) not in whole:
                gathered = full_tensor(value)
                whole[id(value)] = gathered.to("cpu") if keep else gathered.new_empty(0)
            if keep:
                out[hf_parameter_name(name)] = whole[id(value)]
    return dict(merged_tensors(out.items(), merge_plan(model, hf_parameter_name))) if keep else None


@contextlib.contextmanager
def _saved_as_served(model: Any, tokenizer: Any) -> Iterator[None]:
    """The config a user serves with: the KV cache on (training turns it off), and a generation
    config that knows the tokenizer's end and padding tokens; the live model is left as it was."""
    config, generation = model.config.use_cache, model.generation_config
    model.config.use_cache = True
    if generation is not None:
        served = copy.deepcopy(generation)
        for field in ("eos_token_id", "pad_token_id", "bos_token_id"):
            if getattr(served, field, None) is None and getattr(tokenizer, field, None) is not None:
                setattr(served, field, getattr(tokenizer, field))
        model.generation_config = served
    try:
        yield
    finally:
        model.config.use_cache, model.generation_config = config, generation


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No transformers progress bar ("Writing model shards") in the run's log."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def write_pretrained(
    model: Any,
    tokenizer: Any,
    out: str | Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """``model`` (with ``state_dict`` as its weights when given: the gathered whole tensors of a
    sharded model) and ``tokenizer`` saved with ``save_pretrained`` into ``out``, atomically."""

    def write(tmp: Path) -> None:
        with _saved_as_served(model, tokenizer), _quiet():
            model.save_pretrained(
                str(tmp), state_dict=None if state_dict is None else dict(state_dict)
            )
        tokenizer.save_pretrained(str(tmp))

    return write_dir_atomically(out, write)


# ---- reading a checkpoint -----------------------------------------------------------------------


def _where(path: Path) -> str:
    return f"`--ckpt_path`: checkpoint {str(path)!r}"


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], dict | None]:
    """(hyperparameters, policy parameter shapes, policy state dict or None for a DCP directory).
    Files are read ``weights_only`` (plain data and tensors); a DCP directory's ``.metadata`` with
    only the types a checkpoint's metadata holds (:func:`read_dcp_shapes`), before torch reads it."""
    if not path.exists():
        raise CheckpointError(f"{_where(path)} does not exist")
    if path.is_dir():
        if not is_dcp_dir(path):
            raise CheckpointError(
                f"{_where(path)} is a directory but not a distributed (DCP) checkpoint (no "
                ".metadata, no *.distcp shards); give a .ckpt file or a DCP checkpoint directory"
            )
        try:
            shapes = read_dcp_shapes(path)
        except CheckpointError as err:
            raise CheckpointError(f"`--ckpt_path`: {err}") from None
        state, weights = _torch_load(path / "meta.pt", path), None
    else:
        state = _torch_load(path, path)
        weights = state.get("state_dict")
        shapes = {k: tuple(v.shape) for k, v in (weights or {}).items() if hasattr(v, "shape")}
    hparams = state.get("hyper_parameters") or {}
    if not isinstance(hparams.get("model"), str) or not any(
        k.startswith(POLICY_PREFIX) for k in shapes
    ):
        raise CheckpointError(
            f"{_where(path)} is not a checkpoint of `earl fit` or `earl sft`: it names no model "
            "in its hyperparameters or holds no policy weights"
        )
    return hparams, _policy_only(shapes), None if weights is None else _policy_only(weights)


def _torch_load(file: Path, path: Path) -> dict[str, Any]:
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read the file is the file's
        raise checkpoint_unreadable(path, err, arg="--ckpt_path") from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{_where(path)} is not a Lightning checkpoint: it holds a {type(state).__name__}"
        )
    return state


def _policy_only(entries: Mapping[str, Any]) -> dict[str, Any]:
    return {k[len(POLICY_PREFIX) :]: v for k, v in entries.items() if k.startswith(POLICY_PREFIX)}


def _load_dcp_policy(path: Path, model: torch.nn.Module) -> None:
    """The policy's tensors of the DCP directory ``path``, read in this one process into ``model``
    (DCP reassembles each whole tensor from the shards the processes wrote), as data only
    (:func:`load_dcp`: a shard's non-tensor entry is never unpickled as code)."""
    # DCP flattens nested keys with "."; the checkpoint also holds the optimizer and the value
    # head, which the export leaves behind (a partial load).
    wanted = {"state_dict": {POLICY_PREFIX + k: v for k, v in model.state_dict().items()}}
    try:
        with torch.no_grad():
            load_dcp(wanted, path, partial=True)
    except CheckpointError as err:
        raise CheckpointError(f"`--ckpt_path`: {err}") from None


def rebuild_policy(
    path: Path, model_name: str | None = None, out: str | None = None
) -> tuple[Any, Any]:
    """(model, tokenizer) of the checkpoint at ``path``: the model it was trained from (or
    ``model_name``), with the checkpoint's policy weights, checked to be that model's. ``out``,
    the directory to be written, may not be or hold the model directory read."""
    hparams, shapes, weights = read_checkpoint(path)
    name = model_name or hparams["model"]
    arg = "--model" if model_name else f"--ckpt_path's model ({path.name}: hyper_parameters.model)"
    problem = out and overlap_problem(
        out, "--out", [(name if Path(name).exists() else None, f"the model read (`{arg}`)")]
    )
    if problem:
        raise ValueError(problem)
    model = load_model(name, hparams.get("dtype", "float32"), arg)
    if hparams.get("peft") is not None:  # the adapters' weights are in the checkpoint too
        apply_lora(
            model, coerce(LoraSettings, hparams["peft"], f"--ckpt_path's peft ({path.name})")
        )
    tokenizer = load_tokenizer(name, arg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        check_checkpoint_matches(path, shapes, expected)
    except CheckpointError as err:
        raise CheckpointError(f"`--ckpt_path`: {err}") from None
    if weights is None:
        _load_dcp_policy(path, model)
    else:
        model.load_state_dict(weights, strict=True)
    return model, tokenizer


def export_checkpoint(
    ckpt_path: str, out: str, overwrite: bool = False, model: str | None = None
) -> Path:
    """``earl export``: the checkpoint's policy as a ``save_pretrained`` directory at ``out``.
    ``out`` is checked first: not a file, empty unless ``overwrite``, and never the checkpoint read
    nor a directory holding it (or inside it), which writing ``out`` would delete."""
    read = f"the checkpoint read (`--ckpt_path` {ckpt_path!r})"
    problem = (
        output_dir_problem(out, overwrite, "--out")
        or overlap_problem(out, "--out", [(ckpt_path, read)])
        or inside_problem(out, "--out", ckpt_path, read)
    )
    if problem is not None:
        raise ValueError(problem)
    with local_checkpoint(ckpt_path) as path:
        policy, tokenizer = rebuild_policy(path, model, out)
    written = write_pretrained(policy, tokenizer, out, gather_state_dict(policy, keep=True))
    print(
        f"earl: exported the policy of {ckpt_path!r} to {str(written)!r}; load it with "
        f"AutoModelForCausalLM.from_pretrained({str(written)!r}) or vllm.LLM({str(written)!r})"
    )
    return written


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="earl export",
        description=(
            "Write a checkpoint's policy as a save_pretrained directory (weights, config, generation config, "
            "tokenizer with its chat template) that transformers and vLLM load."
        ),
    )
    for flag, kwargs in EXPORT_ARGS.items():
        parser.add_argument(f"--{flag}", **kwargs)
    return parser


def export_command(argv: list[str]) -> None:
    """``earl export``: argument parsing, then :func:`export_checkpoint`; errors as one line."""
    ns = export_parser().parse_args(argv)
    try:
        export_checkpoint(ns.ckpt_path, ns.out, ns.overwrite, ns.model)
    except (EarlError, ValueError, FileNotFoundError) as err:
        console.error(f"earl: error: {err}")
        raise SystemExit(2) from None


# ``earl export``'s arguments (also docs/configuration.md's rows)
EXPORT_ARGS: dict[str, dict[str, Any]] = {
    "ckpt_path": {
        "required": True,
        "help": "A checkpoint of `earl fit` (or `earl sft`): a Lightning .ckpt file (a path, or a URL: "
        "downloaded, then read like a file), or the distributed (DCP) checkpoint directory EarlStrategy writes.",
    },
    "out": {
        "required": True,
        "help": "The directory to write (new or empty, unless --overwrite); never the checkpoint or "
        "the model read, nor a directory that holds them.",
    },
    "overwrite": {"action": "store_true", "help": "Replace --out when it exists and is not empty."},
    "model": {
        "default": None,
        "help": "The model the checkpoint was trained from, when its saved "
        "hyperparameters name a path that has moved (hub id, directory or preset).",
    },
}

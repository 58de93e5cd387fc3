"""Load any causal LM and its tokenizer by hub id or local path through ``from_pretrained``; read,
check and write its checkpoint files with errors that name the file and what is wrong."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from earl_lightning.core.errors import ModelFilesError
from earl_lightning.models.tiny import PRESETS, make_tiny_model

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, arg: str = "dtype") -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"`{arg}` must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_model_path(name_or_path: str, arg: str = "--model.name_or_path") -> str:
    """Turn a model name into something ``from_pretrained`` accepts.

    ``earl-tiny`` (and the other presets) builds the offline model on first use and returns its
    directory. A path that looks local (absolute, ``./``, ``~``, two slashes or more, or in an
    existing directory) must exist, and a local directory must hold a whole model
    (:func:`check_model_dir`). Anything else is a hub id, passed through as is.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(
            f"`{arg}` must be a hub id, a local path or one of {sorted(PRESETS)}; got {name_or_path!r}"
        )
    if name_or_path in PRESETS:
        return str(make_tiny_model(name_or_path))
    expanded = os.path.expanduser(name_or_path)
    # a hub id is "name" or "namespace/name": two slashes or more make a relative path
    looks_local = (
        expanded.startswith(("/", "./", "../"))
        or expanded.count("/") >= 2
        or os.sep in expanded
        and os.path.exists(os.path.dirname(expanded) or ".")
    )
    if looks_local and not Path(expanded).exists():
        raise FileNotFoundError(
            f"`{arg}`: model path {name_or_path!r} does not exist. Pass a local directory made by "
            f"save_pretrained, a hub id (e.g. 'Qwen/Qwen2.5-0.5B-Instruct'), or one of {sorted(PRESETS)}."
        )
    if not Path(expanded).exists():
        return name_or_path
    check_model_dir(Path(expanded), name_or_path, arg)
    return expanded


# What `from_pretrained` needs of a local directory, for the model and for its tokenizer.
_NEEDS = (
    "config.json",
    "model weights (*.safetensors or pytorch_model*.bin)",
    "tokenizer files (tokenizer.json, or a vocabulary such as tokenizer.model, vocab.json or vocab.txt)",
)
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_dir(path: Path, name_or_path: str, arg: str) -> None:
    """A local model directory holds config.json, weights and tokenizer files, or this says which
    are missing (transformers' own errors name neither the argument nor the missing file)."""
    if not path.is_dir():
        raise ModelFilesError(
            f"`{arg}`: {name_or_path!r} is a file, not a model directory; a model directory "
            f"holds {', '.join(_NEEDS)} (what save_pretrained writes for a model and its tokenizer)"
        )
    present = ((path / "config.json").is_file(), _has(path, _WEIGHTS), _has(path, _TOKENIZER))
    missing = [need for need, ok in zip(_NEEDS, present) if not ok]
    what = (
        "an empty directory"
        if next(path.iterdir(), None) is None
        else "not a complete model directory"
    )
    if missing:
        raise ModelFilesError(
            f"`{arg}`: {name_or_path!r} is {what}: missing {', '.join(missing)}. A model directory "
            "is what save_pretrained writes for a model and its tokenizer"
        )
    for index in _INDEXES:
        if (path / index).is_file():
            shards = sorted(
                set(json.loads((path / index).read_text()).get("weight_map", {}).values())
            )
            absent = [s for s in shards if not (path / s).is_file()]
            if absent:
                raise ModelFilesError(
                    f"`{arg}`: {name_or_path!r} is not a complete model directory: {index} names "
                    f"{len(absent)} weight file(s) that are missing: {absent[:3]}"
                )


def load_tokenizer(name_or_path: str, arg: str = "--model.name_or_path"):
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path, arg)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(
            f"`{arg}`: cannot load a tokenizer from {name_or_path!r}: {err}"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(
            f"`{arg}`: tokenizer of {name_or_path!r} has no chat template; multi-turn rollout needs one"
        )
    return tok


def load_model(name_or_path: str, dtype: str = "float32", arg: str = "--model.name_or_path"):
    """A causal LM in train mode on CPU; the strategy moves and shards it."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path, arg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype, "--model.dtype")
        )
    except OSError as err:
        raise FileNotFoundError(
            f"`{arg}`: cannot load a model from {name_or_path!r}: {err}"
        ) from None
    except SafetensorError as err:  # a truncated download or copy of the weights
        raise ModelFilesError(
            f"`{arg}`: the weights in {name_or_path!r} cannot be read ({err}); the file is "
            "truncated or corrupt: copy or download it again"
        ) from None
    return model


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) for a forward that only reads it, then its mode again.

    Generation and log-prob recomputation run like this, so the log-probs the trainer recomputes
    are those of the distribution the rollout sampled from; a frozen reference model stays in
    train mode between uses, as Lightning expects of every module at the start of training."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _has(path: Path, patterns: tuple[str, ...]) -> bool:
    return any(next(path.glob(p), None) is not None for p in patterns)

"""What ``--ckpt_path`` may and may not bring into a run (used by the ``earl`` command).

- A checkpoint's saved hyperparameters never replace the config. LightningCLI merges them into the
  model's arguments, so a model path or an import path stored in a checkpoint (an estimator, a
  loss, a tool parser) would be loaded and run without the user naming it; here the config as the
  user wrote it is what runs, and a difference from the checkpoint's (the model's settings, or the
  data's: env, reward functions, tools) is reported in one line.
- A distributed (DCP) checkpoint directory given to a run under another strategy (``auto``) is
  loaded whole (:class:`~earl_lightning.checkpoints.io.AtomicCheckpointIO`), said in one line;
  under a recipe's own CheckpointIO it is refused in one line saying what to do instead.
- What the command reads of a checkpoint before the run (its settings; a DCP directory's
  ``.metadata``) is read as data only, and a file that cannot be is one line (:func:`check_readable`),
  whether named on the command line or found by ``last``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from earl_lightning.checkpoints.files import dcp_writers, read_dcp_metadata
from earl_lightning.checkpoints.loaders import checkpoint_unreadable
from earl_lightning.core.errors import CheckpointError

SHOWN = 4  # differences named in the line; the rest are counted


def saved_hparams(path: str | Path) -> dict[str, dict[str, Any]]:
    """The settings a checkpoint file (or a DCP directory's ``meta.pt``) saved, read
    ``weights_only``: ``{"model": its hyper_parameters, "data": its datamodule_hyper_parameters}``.
    Raises what ``torch.load`` raises for an unreadable file."""
    path = Path(path)
    file = path / "meta.pt" if path.is_dir() else path
    state = (
        torch.load(file, map_location="cpu", mmap=True, weights_only=True) if file.is_file() else {}
    )
    state = state if isinstance(state, Mapping) else {}
    return {
        group: dict(state[key]) if isinstance(state.get(key), Mapping) else {}
        for group, key in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters"))
    }


def check_readable(path: str | Path) -> None:
    """The checkpoint at ``path`` exists and what is read of it before the run reads as data only:
    a DCP directory's ``.metadata`` (restricted to a checkpoint's types) and the saved settings of
    a file or of a directory's ``meta.pt`` (``weights_only``); else one CheckpointError line naming
    the file (a planted, truncated or corrupt one)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if (path / ".metadata").is_file():
        read_dcp_metadata(path)
    try:
        saved_hparams(path)
    except Exception as err:  # noqa: BLE001 - the torch.load of the file is all that can fail here
        raise checkpoint_unreadable(path, err) from None


def differences(
    saved: Mapping[str, Any], config: Mapping[str, Any], prefix: str
) -> list[tuple[str, Any, Any]]:
    """(``--key``, checkpoint's value, config's value) for each setting both name with different
    values, in the checkpoint's order. A setting only one of them has (added or removed since the
    save) is no difference."""
    out = []
    for key, was in saved.items():
        if key not in config or key.startswith("_"):
            continue
        now, name = config[key], f"{prefix}.{key}"
        if isinstance(was, Mapping) and isinstance(now, Mapping):
            out += differences(was, now, name)
        elif _plain(was) != _plain(now):
            out.append((name, was, now))
    return out


def with_run_seed(settings: dict[str, Any], seed: Any) -> dict[str, Any]:
    """A group's settings with an unset ``seed`` as the run's (what the part was built with)."""
    return (
        {**settings, "seed": seed} if "seed" in settings and settings["seed"] is None else settings
    )


def _plain(value: Any) -> Any:
    """Comparable: tuples as lists, and an empty list or mapping as None (a module may save its
    unset argument as either)."""
    if isinstance(value, (Mapping, list, tuple)) and not value:
        return None
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def differences_line(path: str | Path, found: list[tuple[str, Any, Any]]) -> str | None:
    """One line naming the settings the config gives otherwise than the checkpoint saved them
    (None when they agree): the config's values are used."""
    if not found:
        return None
    shown = [f"`{key}` {now!r} (saved: {was!r})" for key, was, now in found[:SHOWN]]
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return (
        f"earl: `--ckpt_path` {str(path)!r} was saved with other settings; this run uses its config's: "
        f"{', '.join(shown)}{more}"
    )


def dcp_whole_line(path: str | Path, processes: int) -> str:
    """What a run under a strategy that reads single files does with the DCP directory ``path``."""
    writers = dcp_writers(path)
    return (
        f"earl: `--ckpt_path` {str(path)!r} is a distributed (DCP) checkpoint of {writers} "
        f"process{'' if writers == 1 else 'es'}; this run ({processes} process{'' if processes == 1 else 'es'}, "
        "not under EarlStrategy) loads its tensors whole"
    )


def dcp_problem(path: str | Path, strategy: str) -> str:
    """Why a run under ``strategy`` with a CheckpointIO of its own cannot resume from the DCP
    directory ``path``, and what to do instead."""
    path = Path(path)
    writers = dcp_writers(path)
    return (
        f"`--ckpt_path`: checkpoint {str(path)!r} is a distributed (DCP) checkpoint directory, saved by "
        f"{writers} process{'' if writers == 1 else 'es'} under EarlStrategy; this run's strategy ({strategy}) reads single-file checkpoints "
        f"only: resume it with `--trainer.strategy earl --trainer.devices {max(writers, 2)}`, or take its model "
        f"with `earl export --ckpt_path {path} --out DIR`"
    )

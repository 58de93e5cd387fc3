"""The checkpoint writer ``earl fit`` gives the Trainer under every strategy: a kill or a full disk
in the middle of a save never costs the previous checkpoint.

Lightning's own ``TorchCheckpointIO`` stages a file in the system temp directory and moves it into
place without flushing it to disk; on another filesystem the move is a copy a kill can cut short,
leaving a truncated ``last.ckpt``. :class:`AtomicCheckpointIO` writes beside the final name
(``.<name>.partial<pid>``), fsyncs, and renames over it (:func:`save_file_atomically`); what a
killed save left is removed by the next save. EarlStrategy saves its distributed (DCP) directories
atomically itself (``write`` beside, two renames).

It also reads such a directory into a run under another strategy (``auto``, one process or DDP):
the shards are gathered into whole tensors (:func:`load_dcp_whole`), so a multi-process run's
checkpoint resumes, or is evaluated, on one process.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from earl_lightning.checkpoints import read_dcp_shapes, remove_path, save_file_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (temporary file, fsync, rename), and which
    also loads a distributed (DCP) checkpoint directory, whole, into a run that reads single files.
    Remote paths (``s3://...``) go through Lightning's own save, a transaction of their filesystem."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(
                checkpoint, path, storage_options
            )  # raises for storage_options
        path = Path(path)
        if not path.is_dir():
            return save_file_atomically(checkpoint, path)
        # A DCP directory of a run resumed here is replaced by the file: moved aside first (a kill
        # now leaves it as `.<name>.old`, which `--ckpt_path last` resumes from), removed last.
        old = path.with_name(f".{path.name}.old")
        remove_path(old)
        os.replace(path, old)
        save_file_atomically(checkpoint, path)
        remove_path(old)
        return None

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if "://" not in str(path) and Path(path).is_dir():
            return load_dcp_whole(Path(path))
        return super().load_checkpoint(path, weights_only=weights_only)


def load_dcp_whole(path: Path) -> dict[str, Any]:
    """The DCP directory ``path`` (Lightning's ModelParallelStrategy layout: ``state_dict`` and
    ``optimizer_<i>`` in the shards, the rest in ``meta.pt``) as the checkpoint a single-file
    strategy loads: whole tensors, each optimizer's state keyed by parameter index again. Its
    ``.metadata`` is checked first (:func:`read_dcp_shapes`: only a checkpoint's types, every shard whole)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_dcp_shapes(path)
    checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    tensors: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        _load_state_dict(
            tensors,
            storage_reader=FileSystemReader(path),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    checkpoint["state_dict"] = tensors.pop("state_dict")
    count = sum(1 for key in tensors if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [by_index(tensors[f"optimizer_{i}"]) for i in range(count)]
    return checkpoint


def by_index(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``'s, what DCP saves)
    keyed by index, as ``Optimizer.load_state_dict`` takes it: the names' order in the param groups."""
    index: dict[str, int] = {}
    groups = []
    for group in optimizer["param_groups"]:
        groups.append(
            {**group, "params": [index.setdefault(name, len(index)) for name in group["params"]]}
        )
    return {
        "state": {
            index[name]: value for name, value in optimizer["state"].items() if name in index
        },
        "param_groups": groups,
    }


def with_atomic_checkpoint_io(plugins: Any, strategy: Any) -> list[Any] | None:
    """The Trainer's ``plugins`` with an :class:`AtomicCheckpointIO` added, unless the recipe chose
    its own writer (a ``CheckpointIO`` plugin, or a strategy instance built with one): then None,
    and the recipe's stands."""
    listed = (
        []
        if plugins is None
        else list(plugins)
        if isinstance(plugins, (list, tuple))
        else [plugins]
    )
    if any(isinstance(p, CheckpointIO) for p in listed):
        return None
    from lightning.pytorch.strategies import Strategy

    if isinstance(strategy, Strategy) and strategy._checkpoint_io is not None:
        return None
    return [*listed, AtomicCheckpointIO()]

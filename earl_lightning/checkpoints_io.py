"""The checkpoint writer ``earl fit`` gives the Trainer under every strategy: a kill or a full disk
in the middle of a save never costs the previous checkpoint.

Lightning's own ``TorchCheckpointIO`` stages a file in the system temp directory and moves it into
place without flushing it to disk; on another filesystem the move is a copy a kill can cut short,
leaving a truncated ``last.ckpt``. :class:`AtomicCheckpointIO` writes beside the final name
(``.<name>.partial<pid>``), fsyncs, and renames over it (:func:`save_file_atomically`); what a
killed save left is removed by the next save.

:class:`DcpCheckpoints` is EarlStrategy's saving and loading, a mixin placed before
``ModelParallelStrategy`` in its bases (it needs the strategy's collectives and models). Several
processes: a DCP directory, written beside its final name (DCP overwrites shards in place) and
swapped in by rank 0 once every rank's shards are whole, so a crash or a full disk mid-save keeps
the previous checkpoint; loads are checked before anything is read (a truncated shard, a corrupt
file, parameters that do not fit), and DCP reshards a checkpoint saved under another train
layout. One process: nothing is sharded (plain tensors), and DCP's loader insists on a distributed
model, so checkpoints are the ordinary single-file kind, written atomically like
:class:`AtomicCheckpointIO`'s. The host strategy provides ``mark_weights_updated(all_models=True)``,
called after a load.

It also reads such a directory into a run under another strategy (``auto``, one process or DDP):
the shards are gathered into whole tensors (:func:`load_dcp_whole`), so a multi-process run's
checkpoint resumes, or is evaluated, on one process.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import Strategy

from earl_lightning.checkpoints import (
    check_before_load,
    checkpoint_unreadable,
    disk_full_error,
    read_dcp_shapes,
    remove_path,
    replace_dir,
    save_file_atomically,
)
from earl_lightning.errors import CheckpointError


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (temporary file, fsync, rename), and which
    also loads a distributed (DCP) checkpoint directory, whole, into a run that reads single files.
    Remote paths (``s3://...``) go through Lightning's own save, a transaction of their filesystem."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            # raises for storage_options
            return super().save_checkpoint(checkpoint, path, storage_options)
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
    if isinstance(strategy, Strategy) and strategy._checkpoint_io is not None:
        return None
    return [*listed, AtomicCheckpointIO()]


class DcpCheckpoints:
    """Checkpoint saving and loading of a ``ModelParallelStrategy`` subclass (see the module)."""

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """DCP load; a checkpoint saved under another train layout is resharded by DCP itself.

        The checkpoint is checked before anything is loaded: a truncated or corrupt file or shard,
        or parameters that do not fit this model, end the run with one CheckpointError line."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        # a local file or directory (fsspec URLs go to Lightning as they are)
        if "://" not in str(checkpoint_path):
            state = module.state_dict() if self._plain else get_model_state_dict(module)
            check_before_load(
                path,
                one_process=self._plain,
                weights_only=weights_only,
                strict=module.strict_loading,
                expected={k: tuple(v.shape) for k, v in state.items()},
            )
        try:
            if self._plain:
                out = Strategy.load_checkpoint(self, checkpoint_path, weights_only=weights_only)
            else:
                out = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except CheckpointException as err:  # DCP gathers every rank's failure: name the first
            exc = err.failures[min(err.failures)][0]
            raise checkpoint_unreadable(path, exc) from None
        self.mark_weights_updated(all_models=True)
        return out

    # With one process nothing is sharded (the models hold plain tensors, no DTensors), and DCP's
    # loader insists on a distributed model: checkpoints are then the ordinary single-file kind.
    @property
    def _plain(self) -> bool:
        return self.world_size == 1

    @property
    def lightning_restore_optimizer(self) -> bool:
        # DCP restores the optimizer inside load_checkpoint; a plain file is restored by Lightning.
        # (ModelParallelStrategy says False for both, so a one-process resume restarted Adam's state.)
        return self._plain

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return (
            Strategy.lightning_module_state_dict(self)
            if self._plain
            else super().lightning_module_state_dict()
        )

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return (
            Strategy.optimizer_state(self, optimizer)
            if self._plain
            else super().optimizer_state(optimizer)
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        """Save so that a crash or a full disk mid-save leaves the previous checkpoint at ``filepath``
        whole: one process writes a file beside it and renames it over; several write the DCP
        directory beside it (DCP overwrites shards in place) and rank 0 swaps it in once all are done.
        A full disk ends the run with one DiskFullError line."""
        from torch.distributed.checkpoint.api import CheckpointException

        path = Path(self.broadcast(str(filepath)))
        local = (
            type(self.checkpoint_io) is TorchCheckpointIO
            and storage_options is None
            and "://" not in str(path)
        )
        partial = path.with_name(f".{path.name}.partial")  # not *.ckpt: "last" never picks it
        failure = None
        try:
            if self._plain and local:
                return save_file_atomically(checkpoint, path)
            if self._plain:
                return Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)
            if self.global_rank == 0:
                remove_path(partial)  # what an earlier, interrupted save left
            self.barrier()
            super().save_checkpoint(checkpoint, partial, storage_options)
        # DCP's CheckpointException is a BaseException
        except (Exception, CheckpointException) as err:
            full = disk_full_error(err, f"checkpoint {str(path)!r}") if self._plain else None
            if self._plain and full is None:
                raise
            if full is not None:
                raise full from None
            failure = err
        # Rank 0 writes meta.pt after the shards, alone: every rank learns of a failure on any.
        if self.reduce_boolean_decision(failure is None, all=True):
            if self.global_rank == 0:
                replace_dir(partial, path)
            self.barrier()
            return None
        if self.global_rank == 0:
            remove_path(partial)
        if failure is None:
            raise CheckpointError(
                f"saving checkpoint {str(path)!r} failed on another rank; the previous one is kept"
            )
        raise disk_full_error(failure, f"checkpoint {str(path)!r}") or failure

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._plain:
            return Strategy.load_model_state_dict(self, checkpoint, strict=strict)
        return super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._plain:
            return Strategy.load_optimizer_state_dict(self, checkpoint)
        return super().load_optimizer_state_dict(checkpoint)

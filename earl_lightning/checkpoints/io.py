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

Every load here reads data only (:mod:`~earl_lightning.checkpoints.loaders`): files with
``weights_only=True``, a DCP directory's ``.metadata`` and its shards' non-tensor entries through
unpicklers that know only what a save writes; a URL is downloaded and read as a file. None of it
leans on Lightning's or torch's defaults (Lightning loads a URL with ``weights_only=False``, DCP's
default planner every non-tensor entry).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import Strategy

from earl_lightning.checkpoints.files import (
    check_before_load,
    check_checkpoint_matches,
    disk_full_error,
    read_dcp_shapes,
    remove_path,
    replace_dir,
    save_file_atomically,
)
from earl_lightning.checkpoints.loaders import load_dcp, load_file, load_trainer_state
from earl_lightning.checkpoints.urls import is_url, local_checkpoint
from earl_lightning.core.errors import CheckpointError
from earl_lightning.core.lightning_internals import own_checkpoint_io

PathArg = str | Path  # a checkpoint path as Lightning passes it


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (temporary file, fsync, rename), and whose
    loads read data only: a file with ``weights_only=True`` asked for explicitly, a distributed (DCP)
    checkpoint directory whole (:func:`load_dcp_whole`), a URL downloaded first
    (:func:`~earl_lightning.checkpoints.urls.local_checkpoint`), never Lightning's own load of it.
    Given the ``module`` it loads into, a checkpoint of another model is one CheckpointError line
    (its parameters' shapes are checked before they are loaded into it).
    Remote saves (``s3://...``) go through Lightning's own, a transaction of their filesystem."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.module = module

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathArg, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or is_url(path):
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
        self, path: PathArg, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        with local_checkpoint(path) as local:
            if local.is_dir():
                self._check(local, read_dcp_shapes(local))
                return load_dcp_whole(local)
            checkpoint = load_file(local, mmap=False)
            if not isinstance(checkpoint, dict):
                raise CheckpointError(
                    f"checkpoint {str(path)!r} is not a Lightning checkpoint: it holds a "
                    f"{type(checkpoint).__name__}"
                )
            state = checkpoint.get("state_dict") or {}
            self._check(path, {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")})
            return checkpoint

    def _check(self, path: PathArg, found: dict[str, tuple[int, ...]]) -> None:
        if self.module is not None:
            expected = {k: tuple(v.shape) for k, v in self.module.state_dict().items()}
            check_checkpoint_matches(
                path, found, expected, strict=getattr(self.module, "strict_loading", True)
            )


def load_dcp_whole(path: Path) -> dict[str, Any]:
    """The DCP directory ``path`` (Lightning's ModelParallelStrategy layout: ``state_dict`` and
    ``optimizer_<i>`` in the shards, the rest in ``meta.pt``) as the checkpoint a single-file
    strategy loads: whole tensors, each optimizer's state keyed by parameter index again. Checked
    first (:func:`read_dcp_shapes`: only a checkpoint's types, every shard whole), and read as data
    only (:func:`load_dcp`: no entry of a shard is unpickled as code)."""
    read_dcp_shapes(path)
    checkpoint = load_trainer_state(path)
    tensors: dict[str, Any] = {}
    load_dcp(tensors, path, whole=True)
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


def with_atomic_checkpoint_io(
    plugins: Any, strategy: Any, module: torch.nn.Module | None = None
) -> list[Any] | None:
    """The Trainer's ``plugins`` with an :class:`AtomicCheckpointIO` (loading into ``module``)
    added, unless the recipe chose its own writer (a ``CheckpointIO`` plugin, or a strategy
    instance built with one): then None, and the recipe's stands."""
    listed = (
        []
        if plugins is None
        else list(plugins)
        if isinstance(plugins, (list, tuple))
        else [plugins]
    )
    if any(isinstance(p, CheckpointIO) for p in listed):
        return None
    if isinstance(strategy, Strategy) and own_checkpoint_io(strategy) is not None:
        return None
    return [*listed, AtomicCheckpointIO(module)]


class DcpCheckpoints:
    """Checkpoint saving and loading of a ``ModelParallelStrategy`` subclass (see the module)."""

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """DCP load; a checkpoint saved under another train layout is resharded by DCP itself.

        The checkpoint is checked before anything is loaded: a truncated or corrupt file or shard,
        or parameters that do not fit this model, end the run with one CheckpointError line. It
        is read as data only, whatever ``weights_only`` says: files with ``weights_only=True``,
        the shards' non-tensor entries through :func:`load_dcp`; a URL is downloaded first."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = self.lightning_module
        # rank 0's path, as Lightning loads, unless this rank cannot see it (each rank's own
        # download of a URL, on another node)
        common = self.broadcast(str(checkpoint_path))
        own = Path(checkpoint_path).exists() and not Path(common).exists()
        chosen = checkpoint_path if own else common
        with local_checkpoint(chosen) as path:
            state = module.state_dict() if self._plain else get_model_state_dict(module)
            check_before_load(
                path,
                one_process=self._plain,
                strict=module.strict_loading,
                expected={k: tuple(v.shape) for k, v in state.items()},
            )
            if self._plain:
                out = Strategy.load_checkpoint(self, path, weights_only=True)
            elif path.is_dir():
                out = self._load_sharded(path)
            else:
                out = super().load_checkpoint(path, weights_only=True)
        self.mark_weights_updated(all_models=True)
        return out

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        """Lightning's ModelParallelStrategy load of a DCP directory, its reads data only
        (:func:`load_dcp`; Lightning's runs DCP's default planner, which unpickles a shard's
        non-tensor entries as code): the model, then each optimizer, then ``meta.pt``."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        model = self.model
        state = {"state_dict": get_model_state_dict(model)}
        load_dcp(state, path)
        model.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(model, optimizer)}
            load_dcp(state, path)
            set_optimizer_state_dict(
                model,
                optimizer,
                optim_state_dict=state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return load_trainer_state(path)

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

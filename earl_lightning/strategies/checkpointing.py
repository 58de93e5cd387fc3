"""How EarlStrategy saves and loads checkpoints, apart from its layouts: a mixin placed before
``ModelParallelStrategy`` in its bases.

Several processes: a DCP directory, written beside its final name (DCP overwrites shards in place)
and swapped in by rank 0 once every rank's shards are whole, so a crash or a full disk mid-save
keeps the previous checkpoint; loads are checked before anything is read (a truncated shard, a
corrupt file, parameters that do not fit), and DCP reshards a checkpoint saved under another train
layout. One process: nothing is sharded (plain tensors), and DCP's loader insists on a distributed
model, so checkpoints are the ordinary single-file kind, written atomically
(:func:`~earl_lightning.checkpoints.save_file_atomically`). The host strategy provides
``mark_weights_updated(all_models=True)``, called after a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy

from earl_lightning.checkpoints import (
    check_before_load,
    checkpoint_unreadable,
    disk_full_error,
    remove_path,
    replace_dir,
    save_file_atomically,
)
from earl_lightning.errors import CheckpointError


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

"""The checkpoint writer ``earl fit`` gives the Trainer under every strategy: a kill or a full disk
in the middle of a save never costs the previous checkpoint.

Lightning's own ``TorchCheckpointIO`` stages a file in the system temp directory and moves it into
place without flushing it to disk; on another filesystem the move is a copy a kill can cut short,
leaving a truncated ``last.ckpt``. :class:`AtomicCheckpointIO` writes beside the final name
(``.<name>.partial<pid>``), fsyncs, and renames over it (:func:`save_file_atomically`); what a
killed save left is removed by the next save. EarlStrategy saves its distributed (DCP) directories
atomically itself (``write`` beside, two renames).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from earl_lightning.checkpoints import save_file_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (temporary file, fsync, rename).
    Remote paths (``s3://...``) go through Lightning's own save, a transaction of their filesystem."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # raises for storage_options
        save_file_atomically(checkpoint, path)
        return None


def with_atomic_checkpoint_io(plugins: Any, strategy: Any) -> Optional[list[Any]]:
    """The Trainer's ``plugins`` with an :class:`AtomicCheckpointIO` added, unless the recipe chose
    its own writer (a ``CheckpointIO`` plugin, or a strategy instance built with one): then None,
    and the recipe's stands."""
    listed = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if any(isinstance(p, CheckpointIO) for p in listed):
        return None
    from lightning.pytorch.strategies import Strategy

    if isinstance(strategy, Strategy) and strategy._checkpoint_io is not None:
        return None
    return [*listed, AtomicCheckpointIO()]

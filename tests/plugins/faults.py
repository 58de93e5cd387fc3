"""Faults injected into real runs by tests: a rank that dies mid-run, once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L


class KillRank(L.Callback):
    """SIGKILL rank ``rank`` at the start of RL step ``step``, once: ``marker`` records the kill, so
    a restarted run (torchrun ``--max-restarts``, or a re-launch) goes through."""

    def __init__(self, rank: int = 1, step: int = 2, marker: str = "killed.marker") -> None:
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text(f"killed rank {self.rank} at step {self.step}\n")
            os.kill(os.getpid(), signal.SIGKILL)

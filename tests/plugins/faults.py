"""Faults injected into real runs by tests: a rank that dies or stops mid-run, once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Literal

import lightning as L


class KillRank(L.Callback):
    """Send ``sig`` to rank ``rank`` at the start of RL step ``step`` (``at="start"``), or at its
    end (``at="end"``: before the step's checkpoint is saved, so the other ranks next wait in the
    save's collectives), once: ``marker`` records it with the rank's pid, so a restarted run
    (torchrun ``--max-restarts``, or a re-launch) goes through. ``SIGKILL``: the rank dies;
    ``SIGSTOP``: it stays alive but silent until the test kills or continues it (the pid).
    ``linger_s``: the other ranks take that much longer to end the run once it fails (in
    ``on_exception``), as on a loaded machine."""

    def __init__(
        self,
        rank: int = 1,
        step: int = 2,
        marker: str = "killed.marker",
        sig: Literal["SIGKILL", "SIGSTOP"] = "SIGKILL",
        at: Literal["start", "end"] = "start",
        linger_s: float = 0.0,
    ) -> None:
        self.rank, self.step, self.marker, self.sig, self.at = rank, step, Path(marker), sig, at
        self.linger_s = linger_s

    def _maybe(self, trainer: L.Trainer, at: str) -> None:
        if (
            at == self.at
            and trainer.global_rank == self.rank
            and trainer.global_step == self.step
            and not self.marker.exists()
        ):
            verb = "killed" if self.sig == "SIGKILL" else "stopped"
            self.marker.write_text(
                f"{verb} rank {self.rank} at step {self.step} ({at}), pid {os.getpid()}\n"
            )
            os.kill(os.getpid(), getattr(signal, self.sig))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._maybe(trainer, "start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._maybe(trainer, "end")

    def on_exception(self, trainer, pl_module, exception) -> None:
        if trainer.global_rank != self.rank:
            time.sleep(self.linger_s)

"""The faults ``scripts/chaos.py`` puts into a real run, reached by import path with ``scripts/`` on
``PYTHONPATH``: an environment that fails and hangs at seeded random points, a reward function
that hangs on seeded rows, and callbacks that stop a rank (SIGSTOP) and fill the disk before a
save, each once (a marker file records that it happened, so the restarted round goes through).
The rank kill is ``tests.plugins.faults.KillRank``.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import lightning as L

from earl_lightning.envs.base import StepResult, make_env

# the salt that keeps the fault draws apart from the env's own use of the episode seed
_SALT = 0x5EED_FA11


class FlakyEnv:
    """A registered env (``inner``, with ``inner_kwargs``) that, per episode, is drawn faulty from
    the episode seed alone: with probability ``raise_p`` one ``step`` raises, with ``hang_p`` one
    ``step`` sleeps ``hang_s`` (longer than the run's ``env_timeout_s``, so the call is abandoned),
    at a turn drawn from ``[0, max_turn]``. The same seeds give the same faults in every run, so a
    run with the faults and without any other fault is the reference of a chaos run."""

    def __init__(
        self,
        inner: str = "connect_four",
        inner_kwargs: dict | None = None,
        raise_p: float = 0.03,
        hang_p: float = 0.01,
        hang_s: float = 6.0,
        max_turn: int = 3,
    ) -> None:
        self.env = make_env(inner, "data.env_kwargs.inner", **(inner_kwargs or {}))
        self.raise_p, self.hang_p, self.hang_s, self.max_turn = raise_p, hang_p, hang_s, max_turn
        self.fault: str | None = None
        self.fault_turn = self.turn = 0

    def reset(self, seed: int) -> str:
        rng = random.Random(seed ^ _SALT)
        draw, self.fault_turn = rng.random(), rng.randint(0, self.max_turn)
        self.fault = (
            "raise"
            if draw < self.raise_p
            else "hang"
            if draw < self.raise_p + self.hang_p
            else None
        )
        self.turn = 0
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        turn, self.turn = self.turn, self.turn + 1
        if self.fault == "raise" and turn == self.fault_turn:
            raise RuntimeError(f"chaos: a seeded env failure at turn {turn}")
        if self.fault == "hang" and turn == self.fault_turn:
            time.sleep(self.hang_s)
        return self.env.step(action)


_batch_first: tuple[int, ...] | None = None  # the first row of the last batch scored


def hangs_on_some_rows(
    prompts: list, completions: list, completion_ids: list[list[int]], **kwargs
) -> list[float]:
    """A reward function (weight 0 in the chaos run: it scores nothing, it only fails) that hangs on
    rows drawn from their completion's tokens (about 1 in 40), never on a batch's first row (so a
    step always keeps some scored rows and the run goes on): a batch holding one raises, so the
    rows are scored one by one, and on that row alone it sleeps for ever, past the run's
    ``reward_timeout_s``. The rows scored before it keep their scores; it and the rows after it fail
    as unscored (``rewards/errors``), the same rows in every run."""
    global _batch_first
    keys = [tuple(ids) for ids in completion_ids]
    poisoned = [random.Random(hash(k) ^ _SALT).random() < 0.025 for k in keys]
    if len(keys) > 1:
        _batch_first = keys[0]
        if any(poisoned[1:]):
            raise RuntimeError("chaos: a poisoned row in the batch")
    elif poisoned[0] and keys[0] != _batch_first:
        time.sleep(3600)
    return [0.0] * len(keys)


def _once(marker: str) -> bool:
    """True the first time for this marker file (which it then writes), False afterwards."""
    path = Path(marker)
    if path.exists():
        return False
    path.write_text(f"{time.time()}\n")
    return True


class StopRank(L.Callback):
    """SIGSTOP rank ``rank`` at the start of RL step ``step``, once: the process stays alive and
    silent (its peers see no error, only a collective that does not complete)."""

    def __init__(self, rank: int = 1, step: int = 2, marker: str = "stopped.marker") -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (
            trainer.global_rank == self.rank
            and trainer.global_step == self.step
            and _once(self.marker)
        ):
            os.kill(os.getpid(), signal.SIGSTOP)


class FillDisk(L.Callback):
    """At the start of RL step ``step`` (once), rank 0 fills the filesystem that holds ``dirpath``
    with a file, leaving ``keep_bytes`` free, so that the save after that step hits a full disk. The
    restarted round frees the space at set-up (what an operator does before restarting)."""

    def __init__(
        self, dirpath: str, step: int = 2, keep_bytes: int = 4096, marker: str = "disk.marker"
    ) -> None:
        self.filler, self.step, self.keep_bytes, self.marker = (
            Path(dirpath) / "filler.bin",
            step,
            keep_bytes,
            marker,
        )

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank == 0 and self.filler.exists():
            self.filler.unlink()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step and _once(self.marker):
            self.filler.parent.mkdir(parents=True, exist_ok=True)
            stat = os.statvfs(self.filler.parent)
            free = stat.f_bavail * stat.f_frsize - self.keep_bytes
            with self.filler.open("wb", buffering=0) as f:
                while free > 0:
                    chunk = min(free, 1 << 22)
                    try:
                        f.write(b"\0" * chunk)
                    except OSError:  # the filesystem's own accounting ran out first: full is full
                        break
                    free -= chunk

"""Environments and tools for the worker processes of ``call_isolation: process``: each says which
process it ran in, so a test sees where its calls went."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from earl_lightning.envs.base import StepResult
from earl_lightning.envs.calculator import CalculatorEnv

HEAVY = (
    "torch",
    "lightning",
    "transformers",
    "earl_lightning.cli.entry",
    "earl_lightning.cli.fit",
    "earl_lightning.rollout.loop",
)


class Where:
    """One step, reward 1.0, ``info["pid"]`` the process it ran in. The episode of ``hang_seed``
    (every episode: ``always_hang``) computes ``10 ** 10 ** 8`` in its step: minutes inside one C
    call that holds the GIL (no thread can time it out; only killing its process ends it); with
    ``marker`` (a directory), it first writes the file ``marker/<pid>``. ``noisy``: reset's
    observation is drawn from an unseeded generator (not a function of the seed)."""

    def __init__(
        self,
        hang_seed: int = -1,
        always_hang: bool = False,
        marker: str | None = None,
        noisy: bool = False,
    ) -> None:
        self.hang_seed, self.always_hang, self.marker, self.noisy = (
            hang_seed,
            always_hang,
            marker,
            noisy,
        )

    def reset(self, seed: int) -> str:
        self.seed = seed
        return f"Say something ({random.random():.6f})." if self.noisy else "Say something."

    def step(self, action: str) -> StepResult:
        if self.always_hang or self.seed == self.hang_seed:
            if self.marker:
                Path(self.marker, str(os.getpid())).touch()
            base, exponent = 10, 10**8
            base**exponent
        return StepResult("", 1.0, True, {"pid": os.getpid()})


class PidCalculator(CalculatorEnv):
    """The calculator, writing where it runs: each reset appends a line to ``pid_dir/<pid>-<ppid>``
    (the process it lives in and that process's parent)."""

    def __init__(self, pid_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pid_dir = pid_dir

    def reset(self, seed: int) -> str:
        with open(Path(self.pid_dir, f"{os.getpid()}-{os.getppid()}"), "a") as f:
            f.write(f"{seed}\n")
        return super().reset(seed)


def alive(pid: int) -> bool:
    """Whether the process ``pid`` has not ended (a zombie has; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def heavy_modules() -> str:
    """The heavy modules loaded in this process (the CLI, Lightning, torch, the rollout loop), by name."""
    return ",".join(m for m in HEAVY if m in sys.modules) or "none"


def _closure():
    def twice(x: int) -> int:
        """Twice a number.

        Args:
            x: the number.
        """
        return 2 * x

    return twice


twice = _closure()  # a local function: pickle cannot send it to a worker process

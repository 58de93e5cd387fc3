"""The environment a standalone child process gets: the caller's, minus a launcher's variables.

A process group's launcher (torchrun, Lightning's DDP launcher, SLURM's srun through Lightning)
leaves its rendezvous address and ranks in the environment; an in-process run may also keep its
``MASTER_PORT`` bound for the life of the process. A child that starts its own process group (a
benchmark side, a test's ``earl fit --trainer.devices 2``, a GPU acceptance part) must not inherit
them. ``python -m earl_lightning.parallel.launch_env`` prints the names set in the current
environment, one per line (what ``tests/gpu/acceptance.sh`` unsets). :func:`free_port` picks the
port a new single-node rendezvous listens on.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

LAUNCHER_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
)
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def is_launcher_var(name: str) -> bool:
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def standalone_env(environ: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``environ`` (default: this process's) without launcher variables, plus ``extra``."""
    env = {
        k: v
        for k, v in (os.environ if environ is None else environ).items()
        if not is_launcher_var(k)
    }
    env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it): for a store or a
    ``MASTER_PORT`` that a process group about to start binds. Another process may take it in
    between; a launcher that must not fail retries with a new one."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print("\n".join(sorted(k for k in os.environ if is_launcher_var(k))))

"""One rank of a 2-process gloo group whose peer fails on purpose (tests/distributed/test_peer_faults.py):
``python -m tests.distributed.peer_child MODE RANK PORT TIMEOUT_S``. The group joins with a 60 s
timeout and its collectives get TIMEOUT_S (``set_collective_timeout``, as EarlStrategy does), on the
default group and on a ("dp", "tp") = (1, 2) mesh's groups. After a first barrier rank 1 is
SIGKILLed (``kill``) or SIGSTOPped (``stop``, ``stop_mesh``: alive but silent; the test kills it);
rank 0 then all-reduces (``stop_mesh``: over the mesh's tp group; ``stop_later``: over a group
made after the timeout was set, with ``collective_timeout()``, as the dispatcher makes its broadcast
groups) and prints, as one JSON line,
the error torch.distributed raised: its type and text."""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from earl_lightning.parallel.collectives import collective_timeout, set_collective_timeout


def main(mode: str, rank: int, port: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    set_collective_timeout(timedelta(seconds=timeout_s))
    set_collective_timeout(timedelta(seconds=timeout_s), mesh.get_all_groups())
    # as the dispatcher makes its groups
    later = dist.new_group([0, 1], timeout=collective_timeout())
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    try:
        group = {"stop_mesh": mesh.get_group("tp"), "stop_later": later}.get(mode)
        dist.all_reduce(torch.ones(3), group=group)
    except Exception as err:  # noqa: BLE001 - what the test classifies
        print(
            json.dumps(
                {"type": f"{type(err).__module__}.{type(err).__qualname__}", "text": str(err)}
            ),
            flush=True,
        )
        os._exit(0)  # gloo's threads may abort the interpreter's exit with the peer gone
    raise SystemExit("the all-reduce returned with the peer gone")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))

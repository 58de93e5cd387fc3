"""Run a function on N gloo processes on CPU and collect each rank's return value.

Usage in a test: ``results = run_distributed(fn, world_size, *args)``; ``fn(rank, world_size, *args)``
runs after ``init_process_group("gloo")`` and its (picklable) return value comes back in rank order.
An exception on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Set by an in-process Lightning run earlier in the session (its MASTER_PORT may still be bound by
# this pytest process) or by an outer launcher; a child launcher must pick its own.
_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                  "NODE_RANK", "GROUP_RANK", "ROLE_RANK")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment minus distributed-launcher variables, plus ``extra``: what a
    test passes to a child that launches its own process group (``earl fit --trainer.devices 2``)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world_size):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]

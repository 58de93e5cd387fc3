"""Run a function on N gloo processes on CPU and collect each rank's return value.

Usage in a test: ``results = run_distributed(fn, world_size, *args)``; ``fn(rank, world_size, *args)``
runs after ``init_process_group("gloo")`` and its (picklable) return value comes back in rank order.
An exception on any rank fails the test with that rank's traceback; a rank that dies without
reporting (segfault, ``os._exit``, killed for memory) fails it within a fraction of a second, naming
the rank and its exit code or signal. A group that never forms is launched once more on a fresh
port; a second hang fails the test. (The two CI hangs of 4 ranks in gloo's
``createAndConnectAllPairs`` were not the launcher's: they were the dispatcher's TP broadcast
subgroups, named differently on different members; fixed in ``Dispatcher._create_subgroups`` and
pinned in ``tests/distributed/test_dispatch_properties.py``.)
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from earl_lightning.parallel.launch_env import free_port, standalone_env

_POLL_S = 0.2  # how often the parent checks that every rank is still alive while it waits
JOIN_TIMEOUT_S = 120.0  # for every rank to be in the process group (normally seconds)
STALL_ENV = "EARL_TEST_STALL_JOIN"  # launcher tests: "<file>:<n>": rank 0 never joins in the first n launches


class RendezvousHang(RuntimeError):
    """The process group did not form: not within the join timeout, or a rank's
    ``init_process_group`` failed (a port taken between ``free_port`` and the store's bind by
    another job on the machine, whose ranks then meet this one's)."""


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment minus distributed-launcher variables, plus ``extra``: what a
    test passes to a child that launches its own process group (``earl fit --trainer.devices 2``)."""
    # Set by an in-process Lightning run earlier in the session (its MASTER_PORT may still be bound
    # by this pytest process) or by an outer launcher; a child launcher must pick its own.
    return standalone_env(**extra)


# Imported once by the fork server, so that each rank (and each `earl` command of
# tests/earl_process.py) starts forked with them in place instead of
# importing them afresh (~3-9 s of CPU a rank on 2 cores, most of a short distributed test).
_PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "lightning.pytorch",
    "transformers",
    "earl_lightning.modules",
    "earl_lightning.strategies",
    "earl_lightning.callbacks",
    "earl_lightning.cli.entry",
    "earl_lightning.cli.fit",
    "earl_lightning.cli.sft",
    "tests.distributed.launch",
    "tests.earl_process",  # the `earl` commands of tests/earl_process.py fork from this server too
]


def _context():
    """The ranks' start method: ``forkserver`` with :data:`_PRELOAD` imported in the server (a clean
    process: no threads, no process group, no CUDA). The server starts with the first rank and
    serves every later call of this process (setting the same preload again changes nothing)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, queue, environ):
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        try:
            _stall(rank)
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except Exception:  # noqa: BLE001 - a failed rendezvous is launched once more
            queue.put((rank, "join failed", traceback.format_exc()))
            return
        queue.put((rank, "joined", None))
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stall(rank: int) -> None:
    """Launcher tests only: with :data:`STALL_ENV` set to ``<file>:<n>``, rank 0 of each of the first
    ``n`` launches adds a line to the file and never joins (a rendezvous that hangs); with
    ``<file>:<n>:fail`` its join fails instead (a rendezvous that another job's rank broke)."""
    value = os.environ.get(STALL_ENV)
    if rank != 0 or not value:
        return
    path, times, *fail = value.rsplit(":", 2) if value.endswith(":fail") else value.rsplit(":", 1)
    with open(path, "a+") as f:
        f.seek(0)
        if len(f.readlines()) >= int(times):
            return
        f.write("stalled\n")
    if fail:
        raise RuntimeError("Gloo connectFullMesh failed (planted by the test)")
    time.sleep(3600)


def run_distributed(
    fn, world_size: int, *args, timeout: float = 300.0, join_timeout: float = JOIN_TIMEOUT_S
):
    """``fn`` on ``world_size`` gloo processes; their return values in rank order.

    Fails (RuntimeError) as soon as a rank reports an exception, dies without reporting (a segfault,
    ``os._exit``, the OOM killer: named with its exit code or signal), or when ``timeout`` seconds
    pass without every result; the other ranks are then killed, so a test never hangs. A process
    group that has not formed after ``join_timeout`` seconds, or that a rank failed to join, is
    launched once more."""
    try:
        return _launch(fn, world_size, args, timeout, join_timeout)
    except RendezvousHang as first:
        try:
            return _launch(fn, world_size, args, timeout, join_timeout)
        except RendezvousHang as second:
            raise RuntimeError(
                f"distributed worker failed: the gloo group did not form, twice ({first}; then "
                f"{second})"
            ) from None


def _launch(fn, world_size: int, args: tuple, timeout: float, join_timeout: float) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, environ))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        results = _collect(queue, procs, timeout, join_timeout)
    except BaseException:
        _stop(procs, grace_s=0.0)  # survivors may wait forever in a collective with a dead rank
        raise
    # every rank reported: give them time to tear their process group down
    _stop(procs, grace_s=30.0)
    return [results[r] for r in range(world_size)]


def _collect(queue, procs, timeout: float, join_timeout: float = JOIN_TIMEOUT_S) -> dict:
    start = time.monotonic()
    deadline, join_limit = start + timeout, min(join_timeout, timeout)
    results: dict = {}
    joined: set = set()
    while len(results) < len(procs):
        if _receive(queue, results, _POLL_S, joined):
            continue
        waiting = [r for r in range(len(procs)) if r not in joined and r not in results]
        if waiting and time.monotonic() > start + join_limit and not _dead(procs, results):
            raise RendezvousHang(
                f"rank(s) {waiting} not in the process group after {join_limit:g} s"
            )
        # Nothing arrived: is a rank gone? Its result may have reached the pipe just before it
        # exited, so read what is left before calling it dead.
        if _dead(procs, results) and not _receive(queue, results, _POLL_S, joined):
            rank, code = _dead(procs, results)[0]
            raise RuntimeError(
                f"distributed worker failed: rank {rank} died without reporting a result "
                f"({_describe_exit(code)})"
            )
        if time.monotonic() > deadline:
            missing = [r for r in range(len(procs)) if r not in results]
            raise RuntimeError(
                f"distributed worker failed: no result from rank(s) {missing} within {timeout:g} s"
            )
    return results


def _receive(queue, results: dict, wait_s: float, joined: set) -> bool:
    """One report into ``results`` or ``joined`` (False when none came within ``wait_s``); a rank's
    error raises."""
    try:
        rank, status, payload = queue.get(timeout=wait_s)
    except Empty:
        return False
    if status == "joined":
        joined.add(rank)
        return True
    if status == "join failed":  # e.g. another job's rank reached this port's store first
        raise RendezvousHang(f"rank {rank} failed to join: {payload.strip().splitlines()[-1]}")
    if status != "ok":
        raise RuntimeError(f"distributed worker failed\nrank {rank}:\n{payload}")
    results[rank] = payload
    return True


def _dead(procs, results: dict) -> list[tuple[int, int]]:
    """(rank, exit code) of the ranks that ended without a result."""
    return [
        (r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None
    ]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs, grace_s: float) -> None:
    """Join the ranks for up to ``grace_s`` seconds in all, then kill those still running."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)

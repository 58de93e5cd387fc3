"""The pool of worker processes behind ``--model.rollout.call_isolation process``: ``size`` slots,
each one worker process at a time, started together once per trainer process (:func:`worker_pool`)
and reused by every rollout, step after step; :mod:`earl_lightning.rollout.process_env` pins each
episode's environment to a slot.

A worker runs :mod:`earl_lightning.rollout.process_worker`, a light entry module: starting one costs a
fresh interpreter and the import of the environments (a fraction of a second), not the trainer's
command (Lightning, transformers, the model), and it is waited for before any call is timed. A
worker that ends (killed past a time limit, or crashed) is replaced when its slot is next used.
Workers are started by one thread that lives as long as the process, so that the kernel kills them
when the trainer dies (``PR_SET_PDEATHSIG`` is tied to the thread that started a process); the pool
ends them at exit (``atexit``) or at :func:`shutdown_workers`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

# a worker's start-up (an interpreter and the environments' imports), not timed per call
READY_TIMEOUT_S = 120.0


class WorkerLost(RuntimeError):
    """The worker process ended during a call (killed past the time limit, or it crashed)."""


def pool_size(workers: int) -> int:
    """Worker processes for ``call_workers`` threads: no more than the threads (each call in flight
    holds one) nor the CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(workers, cpus or 1))


class _Worker:
    """One worker process and its socket; :meth:`request` sends one request and waits for the
    answer. Started by the pool's spawner thread (see :mod:`process_worker` on PR_SET_PDEATHSIG)."""

    def __init__(self) -> None:
        import multiprocessing

        self.conn, child = multiprocessing.Pipe()
        root = str(Path(__file__).resolve().parents[2])  # where this copy of the package is
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "earl_lightning.rollout.process_worker"]
            + [str(child.fileno()), str(os.getpid())],
            pass_fds=[child.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn.send([p or os.getcwd() for p in sys.path])
        self.pid, self.ready = self.proc.pid, False
        self.loaded: set[bytes] = set()  # the `load` payloads this process has imported

    def wait_ready(self) -> None:
        if self.ready:
            return
        try:
            if not self.conn.poll(READY_TIMEOUT_S):
                raise TimeoutError(f"not ready after {READY_TIMEOUT_S:g} s")
            self.conn.recv()
        except (TimeoutError, EOFError, OSError) as exc:
            self.kill()
            raise RuntimeError(
                f"a worker process of `call_isolation: process` did not start ({exc}; exit code "
                f"{self.proc.poll()}); its error, if any, is above"
            ) from None
        self.ready = True

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, op: str, key: int, payload: bytes) -> bytes:
        """The pickled answer; :class:`WorkerLost` when the process ends first."""
        try:
            self.conn.send((op, key, payload))
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            self.reap()
            raise WorkerLost(
                f"its worker process {self.pid} ended during the call (exit code "
                f"{self.proc.returncode})"
            ) from None

    def drop(self, key: int) -> None:
        try:
            self.conn.send(("drop", key, b""))
        except OSError:
            pass  # it has ended: nothing to forget

    def kill(self) -> None:
        """End the process now (the thread waiting for its answer gets :class:`WorkerLost`)."""
        if self.alive:
            self.proc.kill()

    def close(self) -> None:
        """The end of its pipe: an idle worker exits (the caller kills a busy one, and reaps it)."""
        self.conn.close()

    def reap(self, timeout_s: float = 5.0) -> None:
        """Wait for the process to end (killed after ``timeout_s``), so that no zombie is left."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Slot:
    """One place in the pool: its current worker, replaced when it ends. ``lock``: one request at a
    time, held from sending a request to reading its answer."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool, self.lock = pool, threading.Lock()
        self.worker: _Worker = _spawn()
        self.envs = 0  # environments pinned here (for the round robin)

    def current(self) -> _Worker:
        """The live worker (a fresh one if the last has ended), ready; with ``lock`` held."""
        if not self.worker.alive:
            self.worker.close()
            self.worker.reap()
            self.worker = _spawn()
        self.worker.wait_ready()
        return self.worker


class WorkerPool:
    """``size`` worker processes, started at once and reused; :meth:`close` ends them."""

    def __init__(self, size: int) -> None:
        self.size, self.users, self.owner = size, 0, os.getpid()
        self._lock = threading.Lock()
        self.slots = [_Slot(self) for _ in range(size)]
        for slot in self.slots:  # all start at once; waited for here, before any call is timed
            with slot.lock:
                slot.current()
        self._next = itertools.count()

    def assign(self) -> _Slot:
        """The slot a new episode is pinned to: the one with the fewest episodes, in turn."""
        with self._lock:
            start = next(self._next) % self.size
            slot = min(self.slots[start:] + self.slots[:start], key=lambda s: s.envs)
            slot.envs += 1
            return slot

    def unassign(self, slot: _Slot) -> None:
        with self._lock:
            slot.envs -= 1

    def pids(self) -> list[int]:
        """The worker processes now."""
        return [s.worker.pid for s in self.slots]

    def close(self) -> None:
        """End every worker: an idle one at the end of its pipe, a busy one killed; all reaped."""
        for slot in self.slots:
            if slot.lock.locked():
                slot.worker.kill()
            slot.worker.close()
        for slot in self.slots:
            slot.worker.reap(timeout_s=2.0)


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()
_SPAWNS: tuple[int, queue.SimpleQueue] | None = None  # (the process, its spawner's requests)
_SPAWNS_LOCK = threading.Lock()


def _spawn() -> _Worker:
    """A new worker, started by this process's spawner thread, which lives as long as the process:
    a worker's death signal is tied to the thread that started it."""
    global _SPAWNS
    with _SPAWNS_LOCK:
        if _SPAWNS is None or _SPAWNS[0] != os.getpid():
            _SPAWNS = (os.getpid(), queue.SimpleQueue())
            threading.Thread(
                target=_spawner, args=(_SPAWNS[1],), name="earl-env-spawner", daemon=True
            ).start()
        spawns = _SPAWNS[1]
    done: Future = Future()
    spawns.put(done)
    return done.result()


def _spawner(spawns: queue.SimpleQueue) -> None:
    while True:
        done = spawns.get()
        try:
            done.set_result(_Worker())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of _spawn()
            done.set_exception(exc)


def worker_pool(size: int) -> WorkerPool:
    """This process's pool (started on first use, ``size`` processes), with one more user;
    :func:`release_pool` when done. A different size starts a new pool once no one uses the
    current one."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.owner != os.getpid():
            _POOL = None  # a fork's copy: its workers are the parent's
        if _POOL is not None and _POOL.size != size and _POOL.users == 0:
            atexit.unregister(_POOL.close)
            _POOL.close()
            _POOL = None
        if _POOL is None:
            _POOL = WorkerPool(size)
            atexit.register(_POOL.close)
        _POOL.users += 1
        return _POOL


def release_pool(pool: WorkerPool) -> None:
    with _POOL_LOCK:
        pool.users -= 1


def shutdown_workers() -> None:
    """End this process's pool now (the next :func:`worker_pool` starts a fresh one)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and pool.owner == os.getpid():
        atexit.unregister(pool.close)
        pool.close()

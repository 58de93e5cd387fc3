"""The worker pool behind :class:`~earl_lightning.rollout.env_calls.EnvCalls`: daemon threads
that run submitted calls, each bounded by a time limit measured from when a worker started it.

Python cannot stop a thread: a call that does not return in time is abandoned (marked
``timed_out``, the stack it is stuck in kept), its worker retires once the call returns, and a
fresh worker takes its place at once; a call with an ``on_abandon`` hook (a call into a worker
process) is ended by it. :class:`Pending` groups the calls of one episode until they are done.

A call's clock starts when a worker takes it, or, for a ``clocked`` call, when the call itself says
so (:func:`start_clock`): a call into a worker process first waits for that process (busy with
another episode's call, or starting), and that wait is not the call's time.

:func:`run_here` runs a call on the calling (main) thread instead, under the same limit
(:mod:`earl_lightning.tasks.deadline` interrupts it), and says whether it waited: a call that only
computes gains nothing from a thread (the GIL runs one at a time) and costs tens of microseconds
less without one.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from earl_lightning.tasks.deadline import SIGNAL_POLL_S, CallTimeout, call_limited

# A call waited (on I/O, a sleep, a lock, another process) when it spent more than this many seconds,
# and more than half its time, off the CPU
WAIT_S = 0.0005

# the job the current worker thread runs, and its pool's condition (for start_clock)
_current = threading.local()


def start_clock() -> None:
    """Start (or restart) the time limit of the ``clocked`` call this thread runs: the call is about
    to do what its limit bounds. Outside a pool's worker, nothing."""
    job, cond = getattr(_current, "job", None), getattr(_current, "cond", None)
    if job is None or cond is None:
        return
    with cond:
        job.started = time.monotonic()
        cond.notify_all()  # a waiter recomputes when the next time limit falls


class Pending:
    """Calls in flight for one episode; :meth:`result` once :attr:`done`."""

    def __init__(self, jobs: list[CallJob], finish: Callable[[list[CallJob]], Any]) -> None:
        self.jobs, self._finish = jobs, finish

    @property
    def done(self) -> bool:
        return all(j.future.done() or j.timed_out for j in self.jobs)

    def result(self) -> Any:
        return self._finish(self.jobs)


class CallJob:
    """One submitted call: its future, when its clock started, and the worker running it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        on_abandon: Callable[[], Any] | None = None,
        clocked: bool = False,
        future: Any = None,
    ) -> None:
        self.fn, self.args, self.on_abandon = fn, args, on_abandon
        self.future = Future() if future is None else future
        self.clocked = clocked
        self.started: float | None = None
        self.thread: threading.Thread | None = None
        self.timed_out, self.stack = False, ""
        self.here = self.waited = False  # ran on the calling thread (run_here); and waited there


class _Settled:
    """What :func:`run_here`'s job holds in place of a Future (which a call that ran on the calling
    thread does not need: it is settled when the job is returned)."""

    __slots__ = ("_value", "_exc", "_set")

    def __init__(self) -> None:
        self._value: Any = None
        self._exc: BaseException | None = None
        self._set = False

    def set_result(self, value: Any) -> None:
        self._value, self._set = value, True

    def set_exception(self, exc: BaseException) -> None:
        self._exc, self._set = exc, True

    def done(self) -> bool:
        return self._set

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        if self._exc is not None:
            raise self._exc
        return self._value


def run_here(fn: Callable[..., Any], args: tuple, timeout_s: float | None) -> CallJob:
    """``fn(*args)`` on this thread, now: the job done (or ``timed_out``, interrupted at
    ``timeout_s`` where it was, that place in ``stack``), ``waited`` set when it spent more than
    :data:`WAIT_S` and half its time off the CPU. With a limit it must run on the main thread
    (:func:`~earl_lightning.tasks.deadline.can_interrupt`), the interrupt's handler installed
    (:func:`~earl_lightning.tasks.deadline.install_handler`)."""
    job = CallJob(fn, args, future=_Settled())
    job.here, job.thread = True, threading.current_thread()
    job.started, cpu = time.monotonic(), time.thread_time()

    def late(frame: Any) -> None:
        job.stack = "".join(traceback.format_stack(frame)) if frame is not None else ""

    try:
        if timeout_s is None:
            job.future.set_result(fn(*args))
        else:
            job.future.set_result(call_limited(lambda: fn(*args), timeout_s, late))
    except CallTimeout:
        job.timed_out = True
    except BaseException as exc:  # noqa: BLE001 - handed to the rollout, as a worker's would be
        job.future.set_exception(exc)
    off_cpu = (time.monotonic() - job.started) - (time.thread_time() - cpu)
    job.waited = job.timed_out or (
        off_cpu > WAIT_S and 2 * off_cpu > time.monotonic() - job.started
    )
    return job


class CallPool:
    """Up to ``workers`` daemon threads running submitted calls in submission order, started as the
    calls need them. A worker whose call is abandoned (:meth:`wait`'s time limit) retires once its
    call returns, and no longer counts: a fresh worker may take its place at once."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._retired: set[int] = set()
        self._live = 0  # workers not retired
        self._queued = 0  # jobs submitted and not yet taken by a worker
        self._busy = 0  # workers running a job (not retired)

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        on_abandon: Callable[[], Any] | None = None,
        clocked: bool = False,
    ) -> CallJob:
        """Run ``fn(*args)`` on a worker; ``clocked``: its time limit starts at :func:`start_clock`,
        not when a worker takes it."""
        job = CallJob(fn, args, on_abandon, clocked)
        with self._done:
            self._queued += 1
            if self._busy + self._queued > self._live and self._live < self.workers:
                self._spawn()
        self._jobs.put(job)
        return job

    def wait(
        self, groups: Sequence[Sequence[CallJob]], timeout_s: float | None, first: bool = False
    ) -> None:
        """Until every group of jobs is done (``first``: one group, when any is given) or, with
        ``timeout_s``, has run that long since it started."""
        jobs = [j for g in groups for j in g]
        with self._done:
            while True:
                now = time.monotonic()
                if timeout_s is not None:
                    for j in jobs:
                        if (
                            not j.future.done()
                            and not j.timed_out
                            and j.started is not None
                            and now - j.started >= timeout_s
                        ):
                            self._abandon(j)
                finished = [all(j.future.done() or j.timed_out for j in g) for g in groups]
                if all(finished) or (first and any(finished)):
                    return
                starts = [
                    j.started
                    for j in jobs
                    if not j.future.done() and not j.timed_out and j.started is not None
                ]
                # workers notify when they start and when they finish a call; a slice at a time,
                # so that a signal (ctrl-C) is handled while calls with no limit hang
                left = min(starts) + timeout_s - now if timeout_s and starts else SIGNAL_POLL_S
                self._done.wait(timeout=min(max(left, 0.0), SIGNAL_POLL_S))

    def close(self) -> None:
        for _ in range(self._live):
            self._jobs.put(None)
        self._live = 0

    def _abandon(self, job: CallJob) -> None:
        """Called with the lock held: ``job`` ran too long; its worker retires, and a fresh one
        starts when calls are waiting."""
        job.timed_out = True
        thread = job.thread
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        job.stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        self._retired.add(thread.ident)
        self._live -= 1
        self._busy -= 1
        if self._queued:
            self._spawn()
        # a call in a process of its own: ending the process ends the call
        if job.on_abandon is not None:
            job.on_abandon()

    def _spawn(self) -> None:
        self._live += 1
        threading.Thread(target=self._run, name="earl-env-call", daemon=True).start()

    def _run(self) -> None:
        me = threading.current_thread()
        while (job := self._jobs.get()) is not None:
            with self._done:
                job.thread = me
                if not job.clocked:
                    job.started = time.monotonic()
                self._queued -= 1
                self._busy += 1
                self._done.notify_all()
            _current.job, _current.cond = job, self._done
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting rollout
                job.future.set_exception(exc)
            _current.job = None
            with self._done:
                if me.ident in self._retired:
                    self._done.notify_all()
                    return
                self._busy -= 1
                self._done.notify_all()

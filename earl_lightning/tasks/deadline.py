"""A time limit for a call on the main thread, which keeps running it there.

Some functions must run on the main thread: ``math_verify`` (TRL's ``accuracy_reward``) times each
of its own steps out with ``signal.alarm``, which only the main thread may use. So a reward
function is not moved to a thread to be timed out; instead a watchdog thread, at the limit, sends
the main thread a signal of its own (a real-time signal, not ``SIGALRM``, which ``math_verify``
takes over during its calls), whose handler raises :class:`CallTimeout` where the call is: in a
sleep, a wait on a lock or a socket, a Python loop. It sends it again every second until the call
has ended (a function that swallows the exception is interrupted again). A call stuck inside C
code that never returns to the interpreter (a regular expression backtracking for hours) cannot
be interrupted this way: the watchdog reports where it is stuck (``on_late``) and the call runs on.

The handler raises only while a limited call is armed, and never inside this module's own frames,
so the clean-up around the call cannot be interrupted. One watchdog thread serves every call of the
process (arming a call costs a lock, not a thread), so that cheap calls can be limited too: the
rollout runs environment calls that never wait on the main thread under this limit. Pure Python:
no torch, no trainer.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
# the signal the watchdog sends (None where there are no real-time signals: not Linux)
_SIGNAL: int | None = getattr(signal, "SIGRTMIN", None)
_RESEND_S = 1.0
# The longest a wait of the main thread blocks at once. CPython runs a signal's Python handler on the
# main thread, between bytecodes; a process-directed signal (a terminal's ctrl-C) that the kernel
# hands to another thread does not wake a main thread blocked on a lock or a join without a timeout,
# which then waits for ever with the KeyboardInterrupt pending. Waits that may be long wait in slices
# of this length, so that ctrl-C ends a run within it.
SIGNAL_POLL_S = 0.25


class CallTimeout(BaseException):
    """Raised inside a call that ran past its limit (a BaseException, so that a function's
    ``except Exception`` does not take it for its own error)."""


class _Armed:
    """One limited call: its limit, when it falls, what to call then, and whether it has fired
    (the signal may interrupt it) or ended."""

    __slots__ = ("seconds", "deadline", "on_late", "fired", "ended", "resend_at")

    def __init__(self, seconds: float, on_late: Callable[[Any], None] | None) -> None:
        self.seconds, self.deadline, self.on_late = seconds, time.monotonic() + seconds, on_late
        self.fired = self.ended = False
        self.resend_at = 0.0


class _Watchdog:
    """One daemon thread for the process that watches the armed call: at its deadline it calls
    ``on_late`` once, then signals the main thread every second until the call ends.

    Arming and ending a call cost a lock each (no thread per call: a rollout arms one for every
    environment call it runs on the main thread); the thread is woken only when a call's deadline
    falls before the time it sleeps until.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._call: _Armed | None = None
        self._wake_at = float("inf")  # when the thread wakes by itself (inf: only when notified)
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, on_late: Callable[[Any], None] | None) -> _Armed:
        call = _Armed(seconds, on_late)
        with self._cond:
            self._call = call
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="earl-call-watchdog", daemon=True
                )
                self._thread.start()
            elif call.deadline < self._wake_at:
                self._cond.notify()
        return call

    def end(self, call: _Armed) -> None:
        with self._cond:
            call.ended = True
            if self._call is call:
                self._call = None

    def _run(self) -> None:
        target = threading.main_thread().ident
        with self._cond:
            while True:
                call, now = self._call, time.monotonic()
                due = None if call is None else (call.resend_at if call.fired else call.deadline)
                if due is None or now < due:
                    self._wake_at = float("inf") if due is None else due
                    self._cond.wait(None if due is None else due - now)
                    continue
                if not call.fired:
                    call.fired = True
                    if call.on_late is not None:
                        self._cond.release()  # on_late may log; the call may end meanwhile
                        try:
                            call.on_late(sys._current_frames().get(target))
                        finally:
                            self._cond.acquire()
                        if call.ended:
                            continue
                signal.pthread_kill(target, _SIGNAL)
                call.resend_at = time.monotonic() + _RESEND_S


_watchdog = _Watchdog()
_armed: _Armed | None = None


def _handler(signum: int, frame: Any) -> None:
    call = _armed
    if call is None or not call.fired or call.ended:
        return  # a late signal of a call that has ended: nothing to interrupt
    if frame is not None and frame.f_globals.get("__name__") == __name__:
        return  # this module's own clean-up: the next signal lands in the call
    raise CallTimeout(f"the call did not return within {call.seconds:g} s")


def can_interrupt() -> bool:
    """Whether a call here can be limited by :func:`call_with_limit`: on the main thread of a
    platform with real-time signals (Linux)."""
    return _SIGNAL is not None and threading.current_thread() is threading.main_thread()


def install_handler() -> None:
    """Install the interrupt's signal handler (idempotent). :func:`call_with_limit` does it at every
    call: Lightning's Trainer snapshots every signal's handler when a fit starts and puts them all
    back at its end, so a handler installed during one fit is gone in the next fit or validate of
    the same process. A caller that limits many calls in a row installs it once and uses
    :func:`call_limited`."""
    # Installed for the process: a late signal then never meets the default action, which ends it
    if signal.getsignal(_SIGNAL) is not _handler:
        signal.signal(_SIGNAL, _handler)


def call_with_limit(
    fn: Callable[[], T], seconds: float, on_late: Callable[[Any], None] | None = None
) -> T:
    """``fn()`` on this (the main) thread, interrupted with :class:`CallTimeout` raised inside it
    once it has run ``seconds``; ``on_late(frame)`` is called then, from the watchdog, with the
    main thread's frame (where the call is stuck). Needs :func:`can_interrupt`."""
    install_handler()
    return call_limited(fn, seconds, on_late)


def call_limited(
    fn: Callable[[], T], seconds: float, on_late: Callable[[Any], None] | None = None
) -> T:
    """:func:`call_with_limit` once :func:`install_handler` has run (since the last Lightning fit
    began or ended). A limited call inside another runs under the outer limit only."""
    global _armed
    if _armed is not None:
        return fn()
    call = _watchdog.arm(seconds, on_late)
    _armed = call
    try:
        return fn()
    finally:
        _armed = None
        _watchdog.end(call)

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
so the clean-up around the call cannot be interrupted. Pure Python: no torch, no trainer.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
# the signal the watchdog sends (None where there are no real-time signals: not Linux)
_SIGNAL: int | None = getattr(signal, "SIGRTMIN", None)
_RESEND_S = 1.0


class CallTimeout(BaseException):
    """Raised inside a call that ran past its limit (a BaseException, so that a function's
    ``except Exception`` does not take it for its own error)."""


class _Watch:
    """The watchdog of one call: at ``deadline`` it calls ``on_late`` once, then signals the main
    thread every second until :meth:`stop`."""

    def __init__(self, seconds: float, on_late: Callable[[Any], None] | None) -> None:
        self.seconds, self.on_late = seconds, on_late
        self.fired, self.stopped = False, threading.Event()
        self.lock = threading.Lock()
        self.target = threading.main_thread().ident

    def run(self) -> None:
        if self.stopped.wait(self.seconds):
            return
        with self.lock:
            if self.stopped.is_set():
                return
            self.fired = True
        if self.on_late is not None:
            self.on_late(sys._current_frames().get(self.target))
        while True:
            with self.lock:
                if self.stopped.is_set():
                    return
                signal.pthread_kill(self.target, _SIGNAL)
            if self.stopped.wait(_RESEND_S):
                return

    def stop(self) -> None:
        with self.lock:
            self.stopped.set()


_armed: _Watch | None = None


def _handler(signum: int, frame: Any) -> None:
    watch = _armed
    if watch is None or not watch.fired:
        return  # a late signal of a call that has ended: nothing to interrupt
    if frame is not None and frame.f_globals.get("__name__") == __name__:
        return  # this module's own clean-up: the next signal lands in the call
    raise CallTimeout(f"the call did not return within {watch.seconds:g} s")


def can_interrupt() -> bool:
    """Whether a call here can be limited by :func:`call_with_limit`: on the main thread of a
    platform with real-time signals (Linux)."""
    return _SIGNAL is not None and threading.current_thread() is threading.main_thread()


def call_with_limit(
    fn: Callable[[], T], seconds: float, on_late: Callable[[Any], None] | None = None
) -> T:
    """``fn()`` on this (the main) thread, interrupted with :class:`CallTimeout` raised inside it
    once it has run ``seconds``; ``on_late(frame)`` is called then, from the watchdog, with the
    main thread's frame (where the call is stuck). Needs :func:`can_interrupt`."""
    global _armed
    # Installed for the process (a late signal then never meets the default action, which ends the
    # process), and checked at every call: Lightning's Trainer snapshots every signal's handler when
    # a fit starts and puts them all back at its end, so a handler installed during one fit is gone
    # in the next fit or validate of the same process.
    if signal.getsignal(_SIGNAL) is not _handler:
        signal.signal(_SIGNAL, _handler)
    watch = _Watch(seconds, on_late)
    threading.Thread(target=watch.run, name="earl-call-watchdog", daemon=True).start()
    _armed = watch
    try:
        return fn()
    finally:
        _armed = None
        watch.stop()

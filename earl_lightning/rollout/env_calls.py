"""Guarded environment calls: a fault inside an environment ends its episode, never the rollout.

:class:`EnvCalls` builds, resets and steps the environments of one rollout. An exception, a
return value of the wrong type, or (with ``timeout_s``) a call still running after ``timeout_s``
seconds raises :class:`EnvFault`, whose message names the env, the seed, the call and the
problem; the loop records it as the episode's ``error``. The first fault of each kind in the
process is logged on the ``earl_lightning.rollout`` logger with its traceback (for a hang: the
stack the call is stuck in); later ones are only counted (``env/errors``).

Why :mod:`logging` and not :mod:`warnings`: a log record carries the traceback (``exc_info``),
reaches stderr by default (Python's last-resort handler prints WARNING records when no handler is
configured) or the user's handlers when there are some, and is never turned into an exception by
a ``-W error`` filter in the middle of a rollout; ``warnings``' own de-duplication is by source
line, not by the kind of fault.

Time limit. Python cannot stop a thread, so with ``timeout_s`` every call runs on a worker thread
and the rollout waits for it at most ``timeout_s``. A call that does not return in time fails its
episode, and its env is abandoned: it is never called again. The worker stuck in it is a daemon
thread, left to run until the call returns (or the process exits), and a fresh worker takes the
next calls. Calls still run one at a time, in the loop's order, as without a limit: envs may
share global state (TextArena swaps the global ``random`` state around each call), and running
them concurrently would make episodes depend on thread timing. The price: hangs are waited for
one after another, so a turn in which ``n`` envs hang takes ``n * timeout_s`` longer. An abandoned
call that returns later runs alongside the next calls: if it touches state shared with other envs,
that step's episodes are no longer reproducible (a step without a hang is). With a limit, env calls
run off the main thread (an env that installs signal handlers cannot use one). Without
``timeout_s`` the calls are made directly on the caller's thread (no thread, no overhead).
"""

from __future__ import annotations

import logging
import math
import queue
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from earl_lightning.envs.base import Env, StepResult, check_env_name, make_env
from earl_lightning.parallel.collectives import global_rank, is_distributed
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.tasks.rows import reset_kwargs

log = logging.getLogger("earl_lightning.rollout")
T = TypeVar("T")

_STEP_CONTRACT = "an Env's step must return StepResult(observation, reward, done, info)"
_RESET_CONTRACT = "an Env's reset(seed) must return the first observation as a str"

# The kinds of fault already logged in this process: the first of each is logged, later ones only
# counted. Touched only by the thread that runs the rollout loop.
_logged: set[str] = set()


def reset_logged_faults() -> None:
    """Forget which kinds of fault were logged (tests), so that the next of each is logged again."""
    _logged.clear()


class EnvFault(Exception):
    """A call into an environment failed; ``str(fault)`` is the episode's ``error``."""


class EnvCalls:
    """The environment calls of one rollout, each ended by :class:`EnvFault` when it fails.

    :meth:`close` when the rollout ends lets the worker thread (if any) exit.
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise ValueError(f"`env_timeout_s` must be a number > 0 or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._worker: _Worker | None = None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def start(self, spec: EpisodeSpec) -> tuple[Env | None, str | None]:
        """Build ``spec``'s env and reset it: the env and its first observation; (None, None) for a
        row played without an environment. A row's env is reset with ``reset(seed, **columns)`` (the
        columns its ``reset`` takes) and may return None: the row's prompt alone starts the chat."""
        if spec.env is None:
            return None, None
        check_env_name(spec.env)  # an unknown name or a bad import path is a config error: it raises
        env = self._call(spec, "make_env", lambda: make_env(spec.env, **spec.env_kwargs))
        if spec.row is None:
            observation = self._call(spec, "reset", env.reset, spec.seed)
        else:
            observation = self._call(spec, "reset", lambda: env.reset(spec.seed, **reset_kwargs(env.reset, spec.row)))
            if observation is None:
                return env, None
        if not isinstance(observation, str):
            gym = " (gymnasium's reset returns (observation, info))" if isinstance(observation, tuple) else ""
            raise self._fault(spec, "reset", f"returned {_what(observation)}; {_RESET_CONTRACT}{gym}",
                              f"reset() returned a {type(observation).__name__}")
        return env, observation

    def step(self, spec: EpisodeSpec, env: Env, action: str) -> StepResult:
        """``env.step(action)``, checked (see :func:`_checked`): reward a finite float, done a bool."""
        result = self._call(spec, "step", env.step, action)
        checked = _checked(result)
        if isinstance(checked, tuple):
            raise self._fault(spec, "step", *checked)
        return checked

    def _call(self, spec: EpisodeSpec, name: str, fn: Callable[..., T], *args: Any) -> T:
        if self.timeout_s is None:
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - an env bug ends this episode, not the rollout
                raise self._raised(spec, name, exc) from exc
        if self._worker is None:
            self._worker = _Worker()
        future = self._worker.submit(fn, *args)
        try:
            # exception(timeout) raises TimeoutError only when the call is still running; a
            # TimeoutError the env itself raised comes back as its value, like any other exception
            exc = future.exception(timeout=self.timeout_s)
        except TimeoutError:
            stuck, self._worker = self._worker, None  # abandoned: the next call gets a fresh worker
            stack = stuck.stack()
            stuck.stop()
            raise self._fault(spec, name, f"did not return within env_timeout_s={self.timeout_s:g}s; the env is "
                                          f"abandoned (the call keeps running in a daemon thread)",
                              f"{name}() timeout", stack=stack) from None
        if isinstance(exc, Exception):
            raise self._raised(spec, name, exc) from exc
        return future.result()  # re-raises a KeyboardInterrupt or SystemExit, as a direct call would

    def _raised(self, spec: EpisodeSpec, name: str, exc: BaseException) -> EnvFault:
        kind = f"{name}() raised {type(exc).__module__}.{type(exc).__qualname__}"
        return self._fault(spec, name, f"raised {exc!r}", kind, exc)

    def _fault(self, spec: EpisodeSpec, call: str, problem: str, kind: str, exc: BaseException | None = None,
               stack: str | None = None) -> EnvFault:
        fault = EnvFault(f"env {spec.env!r} (seed {spec.seed}): {call}() {problem}")
        if kind not in _logged:
            _logged.add(kind)
            rank = f"[rank {global_rank()}] " if is_distributed() else ""
            where = f"\nwhere the call is stuck:\n{stack}" if stack else ""
            log.warning("%s%s\n[logged once per kind of fault and process; later faults of this kind (%s) end "
                        "their episode and count in env/errors without a log line]%s", rank, fault, kind, where,
                        exc_info=exc)
        return fault


def _checked(result: Any) -> StepResult | tuple[str, str]:
    """``result`` with a float reward and a bool done, or (what is wrong, the kind of fault)."""
    if isinstance(result, tuple):
        return (f"returned a tuple; {_STEP_CONTRACT} (a gym-style (observation, reward, terminated, truncated, "
                f"info) tuple is not one)", "step() returned a tuple")
    if not isinstance(result, StepResult):
        return f"returned {_what(result)}; {_STEP_CONTRACT}", f"step() returned a {type(result).__name__}"
    try:
        reward = float(result.reward)
    except Exception:  # noqa: BLE001 - any value float() refuses is the env's bug
        reward = math.nan
    if not math.isfinite(reward):
        return f"returned a StepResult whose reward {result.reward!r:.60} is not a finite number", "step() reward"
    try:
        done = bool(result.done)
    except Exception:  # noqa: BLE001 - e.g. a numpy array of several flags
        return f"returned a StepResult whose done {result.done!r:.60} is not a bool", "step() done"
    if not isinstance(result.info, dict):
        return f"returned a StepResult whose info is {_what(result.info)}, not a dict", "step() info"
    if not done and not isinstance(result.observation, str):
        return (f"returned a StepResult whose observation is {_what(result.observation)}, not a str (the episode "
                f"is not done)", "step() observation")
    return StepResult(result.observation, reward, done, result.info)


def _what(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


class _Worker:
    """A daemon thread running submitted calls one at a time, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="earl-env-call", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Let the thread exit once its current call (if one hangs, whenever it returns) is done."""
        self._jobs.put(None)

    def stack(self) -> str:
        frame = sys._current_frames().get(self._thread.ident)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting rollout
                future.set_exception(exc)

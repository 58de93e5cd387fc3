"""Reward functions with TRL's signature, several at once with weights.

A reward function is ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``
(``None``: not applicable to that row), plain or ``async def``, given as a callable or by import
path (``trl.rewards.accuracy_reward``, ``my_package.rewards.fmt``). It receives, by keyword, the
prompts and completions in the prompts' form, the completions' token ids, every other column of
the rows, and TRL's extras (``trainer_state``, ``log_metric``, ``log_extra``); a function without
``**kwargs`` gets only the names it takes.

:func:`call_reward_funcs` calls them all on one batch of rows: the ``async`` ones awaited together
on one event loop (its own thread) while the plain ones run, one after another, on the caller's
thread (``math_verify`` times itself out with ``signal.alarm``, which only the main thread may
use). A function that raises is called again row by row, so that only the rows it cannot score
are lost; a function that returns the wrong number of values, or a value that is not a number,
loses the whole batch. Pure Python: no torch, no trainer.

Time limit (``timeout_s``). A plain function keeps running on the main thread, where
``math_verify`` needs it: at its limit a watchdog interrupts it there
(:mod:`earl_lightning.tasks.deadline`: in a sleep, a wait, a Python loop; not inside C code that
never returns to the interpreter, whose place is then logged). Off the main thread (or without
real-time signals) it runs on a daemon thread of its own instead, waited for at most
``timeout_s``; still running then, it is abandoned, and not called again while that call runs (its
rows fail at once), so a function that hangs for ever holds one thread, not one per step. An
``async`` one is cancelled on the event loop at its limit. Either way a function past its limit
loses the rows it has not scored, as if it had raised, and the first time its stack is logged.
Without a limit the plain functions run on the caller's thread, as they always did.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from earl_lightning.core import console
from earl_lightning.core.checks import is_real
from earl_lightning.core.registry import import_object
from earl_lightning.tasks.deadline import SIGNAL_POLL_S, CallTimeout, call_with_limit, can_interrupt
from earl_lightning.tasks.rows import accepted_kwargs

# What a reward function is handed besides the rows' columns (TRL's names).
CORE_ARGS = ("prompts", "completions", "completion_ids")
EXTRA_ARGS = ("trainer_state", "log_metric", "log_extra")
# Row columns not handed over by name (TRL leaves out the same): the prompt is ``prompts``, and an
# SFT dataset's written completion is not the completion being scored.
NOT_COLUMNS = ("prompt", "completion", "completion_ids")


@dataclass(frozen=True)
class RewardFunction:
    """One reward function, its name (its metrics' name) and weight."""

    fn: Callable[..., Any]
    name: str
    weight: float = 1.0

    @property
    def is_async(self) -> bool:
        method = getattr(self.fn, "__call__", None)  # noqa: B004 - the method itself, not callability
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(method)

    def required(self) -> list[str]:
        """The parameters it must be given (no default), in order."""
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return []
        return [
            p.name
            for p in params
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]


def resolve_reward_funcs(
    funcs: Sequence[Any] | None, weights: Sequence[float] | None, arg: str = "--data.reward_funcs"
) -> list[RewardFunction]:
    """The reward functions of a config: callables, or import paths of callables, with their
    weights (default 1.0 each). Names are the functions' ``__name__`` (made unique with a suffix)."""
    funcs = list(funcs or [])
    warg = arg.rsplit(".", 1)[0] + ".reward_weights"
    if weights is not None:
        weights = list(weights)
        if len(weights) != len(funcs):
            raise ValueError(
                f"`{warg}` has {len(weights)} weights for {len(funcs)} reward functions in `{arg}`; "
                f"give one weight per function (or leave it null: 1.0 each)"
            )
        for w in weights:
            if not is_real(w):
                raise ValueError(
                    f"`{warg}` must be a list of finite numbers, got {w!r} in {weights!r}"
                )
    out: list[RewardFunction] = []
    for i, f in enumerate(funcs):
        fn = import_object(f, f"{arg}[{i}]") if isinstance(f, str) else f
        label = f if isinstance(f, str) else getattr(f, "__name__", type(f).__name__)
        if not callable(fn):
            named = f" {f!r}" if isinstance(f, str) else ""
            raise ValueError(
                f"`{arg}[{i}]`{named} is {type(fn).__name__} {fn!r:.60}, not callable; a reward "
                f"function is fn(prompts, completions, completion_ids, **columns) -> list[float | None]"
            )
        _check_signature(fn, label, f"{arg}[{i}]")
        name = _callable_name(fn)
        taken = {r.name for r in out}
        unique = (
            name
            if name not in taken
            else next(f"{name}_{k}" for k in range(2, len(funcs) + 2) if f"{name}_{k}" not in taken)
        )
        out.append(RewardFunction(fn, unique, float(weights[i]) if weights is not None else 1.0))
    return out


def _callable_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in name)


def _check_signature(fn: Callable[..., Any], label: str, arg: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check before it is called
    params = sig.parameters.values()
    positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        raise ValueError(
            f"`{arg}` {label!r} takes {positional_only} positionally only; reward functions are called "
            f"with keyword arguments (prompts=, completions=, completion_ids=, <column>=)"
        )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    takes = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    if "completions" not in takes:
        raise ValueError(
            f"`{arg}` {label!r} has the signature {sig}, which takes no `completions`; a reward function "
            f"is fn(prompts, completions, completion_ids, **columns) -> list[float | None] (TRL's "
            f"signature: extra columns come as keyword arguments, so give it **kwargs)"
        )


def check_columns(
    funcs: Sequence[RewardFunction], columns: Sequence[str], arg: str = "--data.reward_funcs"
) -> None:
    """Every parameter a function requires is something it will be given (a core argument, an extra
    or a column of the rows), or the error names the function and the missing column."""
    columns = [c for c in columns if c not in NOT_COLUMNS]
    given = set(CORE_ARGS) | set(EXTRA_ARGS) | set(columns)
    for i, f in enumerate(funcs):
        missing = [name for name in f.required() if name not in given]
        if missing:
            raise ValueError(
                f"`{arg}[{i}]` {f.name!r} needs {missing}, which the rows do not have; their columns: "
                f"{sorted(columns)}"
            )


@dataclass
class RewardOutcome:
    """One function's results on a batch: ``values[i]`` (None: not applicable, or not scored)
    and ``errors[i]`` (why row ``i`` could not be scored; None when it was)."""

    values: list[float | None]
    errors: list[str | None]
    metrics: dict[str, list[float]] = field(default_factory=dict)  # log_metric(name, value) calls
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra(column, values) calls


class RewardFunctionError(Exception):
    """A reward function's batch call went wrong in a way that no row can be scored by it."""


def call_reward_funcs(
    funcs: Sequence[RewardFunction],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]],
    extras: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> list[RewardOutcome]:
    """Every function of ``funcs`` on the same ``n`` rows: one :class:`RewardOutcome` each, in order.
    ``columns``: the rows' other columns, a list of ``n`` values each; ``extras``: TRL's extras
    (``trainer_state``, ...); ``log_metric`` and ``log_extra`` are provided here, per function;
    ``timeout_s``: each function's time limit on the batch (None: none; see the module docstring).

    Each ``async`` function is driven from a helper thread that waits on its coroutines, which all
    run on one event loop, so they interleave; the plain functions run meanwhile, one after
    another, on this thread (on a thread of their own when a limit cannot interrupt them here)."""
    calls = [_Call(f, prompts, completions, completion_ids, columns, extras or {}) for f in funcs]
    waiting = [c for c in calls if c.func.is_async and c.start(timeout_s)]
    for c in calls:
        if c.func.is_async:
            continue
        if timeout_s is None:
            c.run()
        elif can_interrupt():
            c.run_interrupted(timeout_s)
        elif c.start(timeout_s):
            c.wait()
    for c in waiting:
        c.wait()
    return [c.outcome() for c in calls]


# The reward functions (by id) whose call was abandoned at its time limit and may still run: the
# thread it runs on, and the limit it ran past.
_abandoned: dict[int, tuple[threading.Thread, float]] = {}
_abandoned_lock = threading.Lock()
_logged_hangs: set[str] = set()  # the functions whose hang was logged (by name)


def _still_running(func: RewardFunction) -> float | None:
    """The limit an earlier call of ``func`` ran past, while that call still runs (else None)."""
    with _abandoned_lock:
        thread, limit = _abandoned.get(id(func.fn), (None, 0.0))
        if thread is not None and not thread.is_alive():
            del _abandoned[id(func.fn)]
            thread = None
        return limit if thread is not None else None


class _Call:
    """One function's call on the batch, and its row-by-row retry when the batch call raises; with
    a time limit, on a thread of its own, abandoned past the limit (:meth:`wait`)."""

    def __init__(
        self,
        func: RewardFunction,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: Mapping[str, list[Any]],
        extras: Mapping[str, Any],
    ):
        n = len(prompts)
        self.func, self.out, self.settled = func, RewardOutcome([None] * n, [None] * n), [False] * n
        self.rows = dict(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
        )
        self.extras = {**extras, "log_metric": self._log_metric, "log_extra": self._log_extra}
        # what the caller's thread reads while this call may still write
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.future: Any = None  # an async function's coroutine in flight
        self.abandoned: RewardOutcome | None = None  # what the caller kept at the time limit
        self.deadline, self.timeout_s = 0.0, 0.0

    def _log_metric(self, name: str, value: float) -> None:
        with self.lock:
            self.out.metrics.setdefault(str(name), []).append(float(value))

    def _log_extra(self, column: str, values: list[Any]) -> None:
        with self.lock:
            self.out.extra[str(column)] = list(values)

    def _call(self, rows: slice) -> Any:
        given = {k: v[rows] for k, v in self.rows.items()}
        result = self.func.fn(**accepted_kwargs(self.func.fn, {**given, **self.extras}))
        if self.func.is_async:
            self.future = asyncio.run_coroutine_threadsafe(result, event_loop())
            return self.future.result()
        return result

    def run(self) -> None:
        n = len(self.rows["prompts"])
        try:
            self._take(slice(0, n), self._call(slice(0, n)))
        except RewardFunctionError as err:
            self._fail(range(n), str(err))
        except Exception:  # noqa: BLE001 - the user's function: find the rows it cannot score
            for i in range(n):
                if self.abandoned is not None:
                    return  # past its limit: the caller has failed the rest
                try:
                    self._take(slice(i, i + 1), self._call(slice(i, i + 1)))
                except RewardFunctionError as err:
                    self._fail([i], str(err))
                except Exception as err:  # noqa: BLE001
                    self._fail([i], _raised(err))

    def run_interrupted(self, timeout_s: float) -> None:
        """:meth:`run` on this (the main) thread, interrupted at ``timeout_s``: the rows it has not
        scored by then fail."""
        self.timeout_s = timeout_s
        try:
            call_with_limit(self.run, timeout_s, self._log_late)
        except CallTimeout:
            with self.lock:
                late = [i for i, done in enumerate(self.settled) if not done]
            self._fail(late, self._late())

    def _late(self) -> str:
        return f"did not return within {self.timeout_s:g} s (`--model.rollout.reward_timeout_s`)"

    def start(self, timeout_s: float | None) -> bool:
        """Run on a daemon thread of its own (limited to ``timeout_s`` when given); False, with
        every row failed, when an abandoned call of this function still runs."""
        limit = _still_running(self.func)
        if limit is not None:
            self._fail(
                range(len(self.settled)),
                f"is still running its call on an earlier batch, abandoned after {limit:g} s; "
                f"its rows are not scored until that call returns",
            )
            return False
        self.timeout_s = timeout_s
        self.thread = threading.Thread(
            target=self.run, name=f"earl-reward-{self.func.name}", daemon=True
        )
        self.deadline = time.monotonic() + (timeout_s or 0.0)
        self.thread.start()
        return True

    def wait(self) -> None:
        """Until the call returns or, with a limit, its deadline: then the rows it has not scored
        fail, an ``async`` call is cancelled, and the thread is left to finish on its own."""
        if self.timeout_s is None:
            while self.thread.is_alive():  # in slices: a ctrl-C is handled meanwhile
                self.thread.join(SIGNAL_POLL_S)
            return
        self.thread.join(max(self.deadline - time.monotonic(), 0.0))
        if not self.thread.is_alive():
            return
        with self.lock:
            late = [i for i, done in enumerate(self.settled) if not done]
            if not late:
                return  # it returned just now
            kept = RewardOutcome(
                list(self.out.values),
                list(self.out.errors),
                {k: list(v) for k, v in self.out.metrics.items()},
                dict(self.out.extra),
            )
            self.abandoned = kept
        for i in late:
            kept.values[i] = None
            kept.errors[i] = self._why(self._late())
        frame = sys._current_frames().get(self.thread.ident)
        # a cancelled coroutine ends its driver thread at once; a blocked one (or a plain function)
        # stays abandoned
        if self.future is not None and self.future.cancel():
            self.thread.join(1.0)
        if self.thread.is_alive():
            with _abandoned_lock:
                _abandoned[id(self.func.fn)] = (self.thread, self.timeout_s)
        self._log_late(frame)

    def outcome(self) -> RewardOutcome:
        return self.abandoned if self.abandoned is not None else self.out

    def _log_late(self, frame: Any) -> None:
        """The first time this function runs past its limit: where it is (``frame``)."""
        with _abandoned_lock:
            if self.func.name in _logged_hangs:
                return
            _logged_hangs.add(self.func.name)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not known)\n"
        console.warn(
            f"reward function {self.func.name!r} did not return within {self.timeout_s:g} s: the "
            f"rows it has not scored are lost [logged once per function]; where it was:\n{stack}",
            every_rank=True,  # this rank's rows
        )

    def _take(self, rows: slice, values: Any) -> None:
        n = rows.stop - rows.start
        if (
            isinstance(values, (str, bytes))
            or not isinstance(values, Sequence)
            and not hasattr(values, "__len__")
        ):
            raise RewardFunctionError(
                f"returned {type(values).__name__} {values!r:.60}; it must return a list of "
                f"{n} floats or None, one per completion"
            )
        values = list(values)
        if len(values) != n:
            raise RewardFunctionError(
                f"returned {len(values)} values for {n} completions; it must return one per "
                f"completion"
            )
        checked = []
        for v in values:
            # numpy / torch scalars
            v = v.item() if hasattr(v, "item") and not isinstance(v, numbers.Real) else v
            if v is None or (isinstance(v, numbers.Real) and math.isnan(float(v))):
                checked.append(None)
            elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
                checked.append(float(v))
            else:
                raise RewardFunctionError(
                    f"returned {v!r:.40} ({type(v).__name__}) among its values; each must be a "
                    f"finite number, or None where it does not apply"
                )
        with self.lock:
            self.out.values[rows] = checked
            self.settled[rows] = [True] * n

    def _fail(self, rows: Any, why: str) -> None:
        with self.lock:
            for i in rows:
                self.out.values[i] = None
                self.out.errors[i] = self._why(why)
                self.settled[i] = True

    def _why(self, why: str) -> str:
        return f"reward function {self.func.name!r} {why}"


def _raised(err: BaseException) -> str:
    return f"raised {type(err).__name__}: {str(err)[:200]}"


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop on a daemon thread for the process's async reward functions (and tools)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="earl-async", daemon=True).start()
            _loop = loop
        return _loop

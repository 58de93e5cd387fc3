"""Guarded environment and tool calls: a fault inside one ends its episode (or becomes the tool's
error message), never the rollout; the calls of all live episodes run at the same time.

:class:`EnvCalls` builds, resets and steps the environments of one rollout and runs their tool
calls. Each batch method (:meth:`EnvCalls.start_all`, :meth:`EnvCalls.step_all`,
:meth:`EnvCalls.tools_all`) hands every call to a pool of ``workers`` daemon threads and waits
for all of them: a turn costs the slowest call, not the sum. An exception, a return value of the
wrong type, or (with ``timeout_s``) a call still running ``timeout_s`` seconds after it started
gives :class:`EnvFault`, whose message names the env, the seed, the call and the problem; the loop
records it as the episode's ``error``. The first fault of each kind in the process is logged on the
``earl_lightning.rollout`` logger with its traceback (for a hang: the stack the call is stuck in);
later ones are only counted (``env/errors``). An ``async def`` reset, step or tool is awaited on
the process's event loop, so such calls interleave there.

Why :mod:`logging` and not :mod:`warnings`: a log record carries the traceback (``exc_info``),
reaches stderr by default (Python's last-resort handler prints WARNING records when no handler is
configured) or the user's handlers when there are some, and is never turned into an exception by
a ``-W error`` filter in the middle of a rollout; ``warnings``' own de-duplication is by source
line, not by the kind of fault.

Time limit. Python cannot stop a thread: a call that does not return in time fails its episode,
its env is abandoned (never called again), and the worker stuck in it is replaced by a fresh one;
the stuck daemon thread runs on until the call returns (or the process exits) and then exits.
An environment that shares state with others (TextArena swaps the global ``random`` state around
each call) guards that state itself; the results of a step do not depend on which calls finished
first. With ``workers=1`` the calls run one at a time in the loop's order. The pool of workers and
its time limit are :mod:`earl_lightning.rollout.call_pool`. Under ``process`` isolation
(:mod:`earl_lightning.rollout.process_env`) a call's clock starts when its request reaches its
worker process, and a call past the limit is ended by killing that process.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from earl_lightning.core import console
from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.envs.base import Env, StepResult, check_env_name, make_env
from earl_lightning.parallel.collectives import global_rank, is_distributed
from earl_lightning.rollout.call_pool import CallJob, CallPool, Pending, run_here
from earl_lightning.rollout.env_faults import (
    RESET_CONTRACT,
    CallFailed,
    EnvFault,
    checked_step,
    what_value,
)
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.tasks.deadline import can_interrupt, install_handler
from earl_lightning.tasks.rows import reset_kwargs
from earl_lightning.tasks.tools import Tool, ToolCall, ToolResult, ToolSet

T = TypeVar("T")

DEFAULT_WORKERS = 16

# The kinds of fault already logged in this process: the first of each is logged, later ones only
# counted. Touched only by the thread that runs the rollout loop.
_logged: set[str] = set()

# Per kind of call (("start", env name), ("step", env class), ("tool", tool name)): [calls run on
# the calling thread, of which waited]. A kind whose calls wait goes to the worker threads for the
# rest of the process, where its calls overlap; one that only computes stays on the calling thread.
_here: dict[Any, list[int]] = {}
_WAIT_STRIKES = 3  # calls that waited before a kind counts as waiting (one preemption is not)
# ... and at least this share of its calls: a kind that waits (a server, a sleep) waits at nearly
# every call, while one that only computes is kept off the CPU now and then by a loaded machine, by
# another thread holding the GIL, or by its first call's imports
_WAIT_SHARE = 0.5


def forget_call_kinds() -> None:
    """Forget which kinds of call were seen to wait (tests): each runs on the calling thread again."""
    _here.clear()


def _waits(key: Any) -> bool:
    calls, waited = _here.get(key, (0, 0))
    return waited >= _WAIT_STRIKES and waited >= _WAIT_SHARE * calls


def reset_logged_faults() -> None:
    """Forget which kinds of fault were logged (tests), so that the next of each is logged again."""
    _logged.clear()


class EnvCalls:
    """The environment and tool calls of one rollout. :meth:`close` when the rollout ends.

    Args:
        timeout_s: the longest a call may run (None: no limit).
        workers: threads running calls at the same time (1: one at a time, in order).
        isolation: ``thread``: environments live in this process; ``process``: in the pool of
            worker processes (:mod:`~earl_lightning.rollout.process_env`: ``processes`` of them,
            started once per trainer process), each episode pinned to one; a worker
            whose call (its tools' included) runs past ``timeout_s`` is killed and replaced: a call
            that holds the GIL ends with it, and only its episode is lost (the others that lived
            there are rebuilt in the fresh worker by replaying their calls).
        task_tools: the task's own tools; under ``process`` isolation each episode's run in its
            environment's worker, see :meth:`tools_for`.
        log_faults: log the first fault of each kind with its traceback (False: a caller that
            reports the fault itself, e.g. the set-up checks' one line).
        processes: the worker processes of ``process`` isolation (None: ``min(workers, CPUs)``,
            :func:`~earl_lightning.rollout.process_pool.pool_size`).
    """

    def __init__(
        self,
        timeout_s: float | None = None,
        workers: int = DEFAULT_WORKERS,
        isolation: str = "thread",
        task_tools: Sequence[Tool] = (),
        log_faults: bool = True,
        processes: int | None = None,
    ) -> None:
        check_number("env_timeout_s", timeout_s, low=0, strict=True, optional=True)
        check_count("call_workers", workers)
        check_choice("call_isolation", isolation, ("thread", "process"))
        check_count("call_processes", processes, optional=True)
        self.timeout_s, self.isolation, self.task_tools = timeout_s, isolation, tuple(task_tools)
        self.log_faults = log_faults
        self._workers = None  # the worker processes (``process`` isolation)
        if isolation == "process":
            from earl_lightning.rollout.process_env import check_picklable, pool_size, worker_pool

            check_picklable(self.task_tools)
            # started (once per trainer process) before any call is timed
            self._workers = worker_pool(processes or pool_size(workers))
        self._pool = CallPool(workers)
        # calls that only compute run on this thread, limited by the deadline's signal (_run)
        self._here_ok = timeout_s is None or can_interrupt()
        self._owner = threading.get_ident()  # the thread that may run calls itself
        if timeout_s is not None and self._here_ok:
            install_handler()
        self._processes: list[Any] = []  # the ProcessEnvs of this rollout, forgotten by close()
        self._hosts: dict[Any, Any] = {}  # episode id -> the ProcessEnv its task tools run in
        self._lock = threading.Lock()

    def close(self) -> None:
        """End the rollout's calls: a call still running is abandoned (in a worker process: killed),
        and the workers forget this rollout's environments (they live on for the next one)."""
        self._pool.close()
        for env in self._processes:  # first: a call still running holds its worker
            env.stop()
        for env in self._processes:
            env.close()
        self._processes.clear()
        self._hosts.clear()
        if self._workers is not None:
            from earl_lightning.rollout.process_env import release_pool

            release_pool(self._workers)
            self._workers = None

    # ---- calls in flight: submit now, collect when done ---------------------------------------
    def submit_start(self, spec: EpisodeSpec) -> Pending:
        """Build and reset ``spec``'s env (see :meth:`start`); the result a ``(env, observation)``
        pair or an :class:`EnvFault`."""
        if spec.env is not None:
            # an unknown name or a bad import path is a config error: it raises
            check_env_name(spec.env)
        if self.isolation == "process" and (spec.env is not None or self.task_tools):
            from earl_lightning.rollout.process_env import check_env_sendable

            if spec.env is not None:
                check_env_sendable(spec.env, "env")
            holder: list[Any] = []
            job = self._pool.submit(
                self._start_process,
                spec,
                holder,
                on_abandon=lambda: [e.kill() for e in holder],
                clocked=True,
            )
        else:
            job = self._run(("start", spec.env), self._start, spec)
        return Pending([job], lambda jobs: self._outcome(jobs[0], spec, "reset"))

    def tools_for(self, spec: EpisodeSpec) -> list[Tool]:
        """The task's tools as ``spec``'s episode calls them: run in its process under ``process``
        isolation (once :meth:`submit_start` has started it), here otherwise."""
        host = self._hosts.get(spec.episode_id)
        return host.hosted() if host is not None else list(self.task_tools)

    def submit_step(self, spec: EpisodeSpec, env: Env, action: str) -> Pending:
        """``env.step(action)``, checked; the result a :class:`StepResult` or an :class:`EnvFault`."""
        kill = _killer(env)
        if kill is None:
            job = self._run(("step", type(env)), self._step, env, action)
        else:
            job = self._pool.submit(self._step, env, action, on_abandon=kill, clocked=True)
        return Pending([job], lambda jobs: self._outcome(jobs[0], spec, "step"))

    def submit_tools(self, tools: ToolSet, calls: Sequence[ToolCall]) -> Pending:
        """Every call of one turn; the result their :class:`ToolResult` list (a call that fails or
        does not return in time is an error result: the model reads its message)."""
        kills = [_killer(tools.owner(call)) for call in calls]
        jobs = [
            self._run(("tool", call.name), tools.call, call)
            if kill is None
            else self._pool.submit(tools.call, call, on_abandon=kill, clocked=True)
            for call, kill in zip(calls, kills)
        ]
        return Pending(jobs, lambda done: [self._tool_result(j, c) for j, c in zip(done, calls)])

    def wait(self, pending: Sequence[Pending], *, first: bool = False) -> list[Pending]:
        """Wait until every one of ``pending`` is done (``first``: at least one), each call at most
        ``timeout_s`` from its start; the done ones, in order."""
        self._pool.wait([p.jobs for p in pending], self.timeout_s, first=first)
        return [p for p in pending if p.done]

    def start_all(
        self, specs: Sequence[EpisodeSpec]
    ) -> list[tuple[Env | None, str | None] | EnvFault]:
        """:meth:`start` for every spec (env None: no call), at the same time."""
        return self._results([self.submit_start(s) for s in specs])

    def step_all(
        self, items: Sequence[tuple[EpisodeSpec, Env, str]]
    ) -> list[StepResult | EnvFault]:
        """``env.step(action)`` for every ``(spec, env, action)``, at the same time."""
        return self._results([self.submit_step(*item) for item in items])

    def tools_all(
        self, items: Sequence[tuple[ToolSet, Sequence[ToolCall]]]
    ) -> list[list[ToolResult]]:
        """Every call of every episode's turn, at the same time."""
        return self._results([self.submit_tools(*item) for item in items])

    def _run(self, key: Any, fn: Callable[..., Any], *args: Any) -> CallJob:
        """``fn(*args)`` on this thread now, when calls of its kind ``key`` only compute and this
        thread can interrupt it at the limit; else on a worker thread. A call that waits (a server,
        a sleep, an ``async`` env) gains from the workers, where the calls of all episodes wait
        together; one that only computes does not (the GIL runs one at a time) and costs tens of
        microseconds less here, which a trivial environment's step is made of."""
        if _waits(key) or not self._here_ok or threading.get_ident() != self._owner:
            return self._pool.submit(fn, *args)
        job = run_here(fn, args, self.timeout_s)
        counts = _here.setdefault(key, [0, 0])
        counts[0] += 1
        # a call that hung: its kind waits from now on, whatever its calls did before
        counts[1] = max(counts[0], _WAIT_STRIKES) if job.timed_out else counts[1] + job.waited
        return job

    def _results(self, pending: list[Pending]) -> list[Any]:
        self.wait(pending)
        return [p.result() for p in pending]

    # ---- one call (the config-time checks use these) -----------------------------------------
    def start(self, spec: EpisodeSpec) -> tuple[Env | None, str | None]:
        """Build ``spec``'s env and reset it: the env and its first observation; (None, None) for a
        row played without an environment. A row's env is reset with ``reset(seed, **columns)`` (the
        columns its ``reset`` takes) and may return None: the row's prompt alone starts the chat."""
        (out,) = self.start_all([spec])
        if isinstance(out, EnvFault):
            raise out
        return out

    def step(self, spec: EpisodeSpec, env: Env, action: str) -> StepResult:
        (out,) = self.step_all([(spec, env, action)])
        if isinstance(out, EnvFault):
            raise out
        return out

    # ---- what runs on a worker ---------------------------------------------------------------
    def _start_process(self, spec: EpisodeSpec, holder: list[Any]) -> tuple[Env | None, str | None]:
        from earl_lightning.rollout.process_env import ProcessEnv

        env = ProcessEnv(self._workers, spec.env, spec.env_kwargs, self.task_tools)
        holder.append(env)
        with self._lock:
            self._processes.append(env)
            if self.task_tools:
                self._hosts[spec.episode_id] = env
        try:
            env.open()
        except Exception as exc:  # noqa: BLE001 - building it failed in its worker
            raise CallFailed.raised("make_env", exc) from exc
        return self._start(spec, env)

    @staticmethod
    def _start(spec: EpisodeSpec, env: Env | None = None) -> tuple[Env | None, str | None]:
        if spec.env is None:
            return None, None
        try:
            env = env if env is not None else make_env(spec.env, **spec.env_kwargs)
        except Exception as exc:  # noqa: BLE001 - an env bug ends this episode, not the rollout
            raise CallFailed.raised("make_env", exc) from exc
        try:
            observation = _awaited(
                env.reset(spec.seed, **(reset_kwargs(env.reset, spec.row) if spec.row else {}))
            )
        except Exception as exc:  # noqa: BLE001
            raise CallFailed.raised("reset", exc) from exc
        if observation is None and spec.row is not None:
            return env, None
        if not isinstance(observation, str):
            gym = (
                " (gymnasium's reset returns (observation, info))"
                if isinstance(observation, tuple)
                else ""
            )
            raise CallFailed(
                "reset",
                f"returned {what_value(observation)}; {RESET_CONTRACT}{gym}",
                f"reset() returned a {type(observation).__name__}",
            )
        return env, observation

    @staticmethod
    def _step(env: Env, action: str) -> StepResult:
        try:
            result = _awaited(env.step(action))
        except Exception as exc:  # noqa: BLE001
            raise CallFailed.raised("step", exc) from exc
        checked = checked_step(result)
        if isinstance(checked, tuple):
            raise CallFailed("step", *checked)
        return checked

    # ---- outcomes ----------------------------------------------------------------------------
    def _outcome(self, job: CallJob, spec: EpisodeSpec, name: str) -> Any:
        if job.timed_out:
            if job.here:
                fate = "it was interrupted where it was and the env is abandoned"
            elif job.on_abandon is not None:
                fate = "its worker process is killed"
            else:
                fate = "the env is abandoned (the call keeps running in a daemon thread)"
            return self._fault(
                spec,
                name,
                f"did not return within env_timeout_s={self.timeout_s:g}s; {fate}",
                f"{name}() timeout",
                stack=job.stack,
            )
        exc = job.future.exception()
        if isinstance(exc, CallFailed):
            return self._fault(spec, exc.call, exc.problem, exc.kind, exc.exc)
        if exc is not None:
            raise exc  # KeyboardInterrupt or SystemExit, as a direct call would
        return job.future.result()

    def _tool_result(self, job: CallJob, call: ToolCall) -> ToolResult:
        if job.timed_out:
            return ToolResult(
                call.name,
                f"Error: {call.name!r} did not return within {self.timeout_s:g} s",
                True,
                float(self.timeout_s or 0.0),
            )
        exc = job.future.exception()
        if exc is not None:  # ToolSet.call catches Exception: only BaseException gets here
            raise exc
        return job.future.result()

    def _fault(
        self,
        spec: EpisodeSpec,
        call: str,
        problem: str,
        kind: str,
        exc: BaseException | None = None,
        stack: str | None = None,
    ) -> EnvFault:
        fault = EnvFault(f"env {spec.env!r} (seed {spec.seed}): {call}() {problem}", exc)
        if self.log_faults and kind not in _logged:
            _logged.add(kind)
            rank = f"[rank {global_rank()}] " if is_distributed() else ""
            where = f"\nwhere the call is stuck:\n{stack}" if stack else ""
            console.warn(
                f"{rank}{fault}\n[logged once per kind of fault and process; later faults of this "
                f"kind ({kind}) end their episode and count in env/errors without a log line]{where}",
                every_rank=True,  # this rank's episodes
                exc_info=exc,
            )
        return fault


def _killer(owner: Any) -> Callable[[], None] | None:
    """What ends a call of ``owner`` that ran too long: killing its process, when it has one."""
    from earl_lightning.rollout.process_env import ProcessEnv, remote_owner

    env = remote_owner(owner) if owner is not None else None
    env = owner if isinstance(owner, ProcessEnv) else env
    return env.kill if env is not None else None


def _awaited(value: Any) -> Any:
    """An ``async def`` env method's result, awaited on the process's event loop (from a worker)."""
    if inspect.isawaitable(value):
        from earl_lightning.tasks.rewards import event_loop

        return asyncio.run_coroutine_threadsafe(_await(value), event_loop()).result()
    return value


async def _await(value: Any) -> Any:
    return await value

"""Episodes' environments and tools in the pool of worker processes
(:mod:`~earl_lightning.rollout.process_pool`; ``--model.rollout.call_isolation process``), so that a
call that never returns, even one that holds the GIL (a long big-integer computation), can be ended
by killing its process.

Each episode is a :class:`ProcessEnv` pinned to one slot of the pool for its life (the slot with
the fewest episodes, in turn): its environment object lives in that slot's worker, which runs one
request at a time, and its tool calls (the environment's own and the task's) go there too. A call's
time limit starts when its request is sent (:func:`~earl_lightning.rollout.call_pool.start_clock`),
not while it waits for the worker, nor while a fresh worker imports the environment's and the
tools' modules (a ``load`` request before the first ``make``: an environment module that imports
torch or Lightning takes seconds to import, as in the trainer before its first episode). A call that runs past ``env_timeout_s`` is ended by killing the
worker (:meth:`ProcessEnv.kill`); the slot starts a fresh one when next needed.

The other episodes whose environments lived in the killed (or crashed) worker are not lost: each
keeps the log of the calls its environment answered (``reset``, ``step``, its own tools) with the
answers, and before its next call rebuilds the environment in the fresh worker by replaying them;
an answer that differs from the logged one (an environment that is not a function of its seed and
calls) fails that episode with :class:`EnvMoved`. The task's own tools are module-level functions
whose state, if any, is shared as under thread isolation: their calls are not replayed.

What crosses the pipe must pickle: the environment's name, its keyword arguments and its factory
(by reference), the task's tool functions (by reference: module-level functions of an importable
module, not ``__main__``), the calls' arguments and their results.
"""

from __future__ import annotations

import itertools
import pickle
import pickletools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from earl_lightning.envs.base import ENVS, StepResult
from earl_lightning.rollout.call_pool import start_clock
from earl_lightning.rollout.process_pool import (
    WorkerLost,
    WorkerPool,
    _Worker,
    pool_size,
    release_pool,
    shutdown_workers,
    worker_pool,
)
from earl_lightning.tasks.tools import Tool

__all__ = [
    "EnvMoved",
    "ProcessEnv",
    "RemoteError",
    "WorkerLost",
    "check_env_sendable",
    "check_picklable",
    "pool_size",
    "release_pool",
    "remote_owner",
    "shutdown_workers",
    "worker_pool",
]

_keys = itertools.count()


class RemoteError(Exception):
    """An exception the environment or tool raised in its worker (its type and message kept)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class EnvMoved(RuntimeError):
    """An environment could not be rebuilt, by replaying its calls, in a fresh worker."""


def check_picklable(tools: Sequence[Tool], arg: str = "--data.tools") -> None:
    """Raise ValueError, naming the tool, when a task tool's function cannot be sent to a worker
    process (a lambda, a closure, a bound method of an object that does not pickle, a function of
    the main script, which a worker does not import)."""
    for tool in tools:
        problem = _unsendable(tool.fn)
        if problem is not None:
            raise ValueError(
                f"`{arg}` tool {tool.name!r} cannot run in a worker process (`call_isolation: "
                f"process`): its function {problem}; define it at module level in an importable "
                f"module, or use `call_isolation: thread`"
            )


def check_env_sendable(name: str, arg: str = "--data.env") -> None:
    """Raise ValueError when the environment ``name`` cannot be built in a worker process."""
    problem = _unsendable(ENVS.get(name, arg))
    if problem is not None:
        raise ValueError(
            f"`{arg}` {name!r} cannot be built in a worker process (`call_isolation: process`): its "
            f"class or factory {problem}; define it in an importable module, or use "
            f"`call_isolation: thread`"
        )


def _unsendable(obj: Any) -> str | None:
    """Why ``obj`` cannot reach a worker process by pickle (None: it can)."""
    try:
        data = pickle.dumps(obj, protocol=2)  # protocol 2 names each global as "module name"
    except Exception as exc:  # noqa: BLE001 - pickle raises several types
        return f"does not pickle ({type(exc).__name__}: {exc})"
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL" and str(arg).startswith("__main__ "):
            return f"is defined in the main script ({str(arg).split(' ')[1]} in __main__)"
    return None


class ProcessEnv:
    """An episode's environment (``name``; None: none) living in a worker process of ``pool``, and
    the task's ``tools`` run there; the same calls as the environment itself, and :meth:`hosted` for
    the task's tools. :meth:`open` builds it (once, before any other call).

    Raises :class:`RemoteError` for an exception inside the environment, :class:`WorkerLost` when
    the worker ends during a call, and :class:`EnvMoved` when the environment cannot be rebuilt in
    a fresh worker."""

    def __init__(
        self, pool: WorkerPool, name: str | None, kwargs: dict[str, Any], tools: Sequence[Tool] = ()
    ) -> None:
        self.name, self.kwargs, self.key = name, dict(kwargs), next(_keys)
        self._slot = pool.assign()
        self._lock = threading.Lock()  # one call at a time per environment, as in-process
        self._built_on: _Worker | None = None
        self._log: list[tuple[str, bytes, bytes]] = []  # (op, payload, answer) to replay
        self._in_flight: _Worker | None = None
        self._closed = False
        self._hosted = [Tool(t.schema, _Remote(self, t.name, t.fn)) for t in tools]
        self._imports: bytes | None = None  # what a fresh worker imports first (see _load)
        self._tools: list[Tool] = []

    def open(self) -> None:
        if self.name is None:
            return
        factory = ENVS.get(self.name, "env")
        schemas = self._call("make", (self.name, self.kwargs, factory))
        self._tools = [Tool(s, _Remote(self, s["function"]["name"])) for s in schemas]

    def hosted(self) -> list[Tool]:
        """The task's tools, each call run in this environment's worker."""
        return list(self._hosted)

    def reset(self, seed: int, **columns: Any) -> Any:
        """The environment's reset, given the columns its own signature takes."""
        return self._call("reset", (seed, columns))

    def step(self, action: str) -> StepResult:
        return self._call("step", (action,))

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def kill(self) -> None:
        """End the worker running this environment's call now (the call ends with it)."""
        worker = self._in_flight
        if worker is not None:
            worker.kill()

    def stop(self) -> None:
        """No call starts from now on, and one still running is ended (the rollout is over)."""
        self._closed = True
        self.kill()

    def close(self) -> None:
        """:meth:`stop`, and forget the environment (its worker lives on for other episodes)."""
        self.stop()
        with self._slot.lock:
            if self._built_on is not None and self._built_on is self._slot.worker:
                self._built_on.drop(self.key)
            self._log.clear()
        self._slot.pool.unassign(self._slot)

    def _call(self, op: str, args: tuple) -> Any:
        payload = pickle.dumps(args)
        with self._lock, self._slot.lock:
            worker = self._slot.current()
            self._load(worker)
            # a task tool needs no environment: it is rebuilt before its next own call
            if op not in ("make", "call") and self._built_on is not worker:
                self._rebuild(worker)
            answer = self._send(worker, op, payload)
            status, value = pickle.loads(answer)
            if op == "make" and status == "ok":
                self._built_on = worker
            elif op in ("reset", "step", "tool"):
                self._log.append((op, payload, answer))
        if status == "raised":
            raise RemoteError(*value)
        return value

    def _send(self, worker: _Worker, op: str, payload: bytes, clock: bool = True) -> bytes:
        """One request, its time limit running from now (:func:`start_clock`) unless ``clock`` is
        false (the call's limit has not started yet, or started with an earlier request)."""
        self._in_flight = worker
        try:
            if self._closed:  # after kill()'s look at _in_flight, or seen by it
                raise WorkerLost("the rollout is over")
            if clock:
                start_clock()
            return worker.request(op, self.key, payload)
        finally:
            self._in_flight = None

    def _load(self, worker: _Worker) -> None:
        """Import the environment's factory and the task's tools in ``worker`` outside any time
        limit, once per process (unpickling them by reference imports their modules)."""
        if self._imports is None:  # pickled once: the factory and the tools do not change
            factory = ENVS.get(self.name, "env") if self.name is not None else None
            self._imports = pickle.dumps((factory, [t.fn.fn for t in self._hosted]))
        if self._imports in worker.loaded:
            return
        status, value = pickle.loads(self._send(worker, "load", self._imports, clock=False))
        if status == "raised":
            raise RemoteError(*value)
        worker.loaded.add(self._imports)

    def _rebuild(self, worker: _Worker) -> None:
        """Build the environment in ``worker`` (its last one ended) and replay its calls."""
        if self._built_on is None:
            raise EnvMoved("the environment was never built (open() first)")
        factory = ENVS.get(self.name, "env")
        made = self._send(worker, "make", pickle.dumps((self.name, self.kwargs, factory)))
        if pickle.loads(made)[0] != "ok":
            raise EnvMoved(f"rebuilding it in a fresh worker process failed: {_said(made)}")
        for i, (op, payload, answer) in enumerate(self._log):
            again = self._send(worker, op, payload)
            if again != answer:
                raise EnvMoved(
                    f"its worker process ended (another call there ran past the time limit, or "
                    f"crashed), and replaying its calls ({len(self._log)}) in a fresh one gave another "
                    f"answer to call {i + 1} ({op}): {_said(again)} instead of {_said(answer)}; an "
                    f"environment is moved only when it is a function of its seed and calls"
                )
        self._built_on = worker


def _said(answer: bytes) -> str:
    status, value = pickle.loads(answer)
    return f"{value!r:.80}" if status == "ok" else f"raised {': '.join(value)[:80]}"


class _Remote:
    """A tool running in the worker of ``env``: its own (``fn`` None) or the task's (``fn``)."""

    def __init__(self, env: ProcessEnv, name: str, fn: Callable[..., Any] | None = None) -> None:
        self.env, self.__name__, self.fn = env, name, fn

    def __call__(self, **arguments: Any) -> Any:
        if self.fn is None:
            return self.env._call("tool", (self.__name__, arguments))
        return self.env._call("call", (self.fn, arguments))


def remote_owner(fn: Any) -> ProcessEnv | None:
    """The :class:`ProcessEnv` a tool's function runs in (None: it runs in this process)."""
    return fn.env if isinstance(fn, _Remote) else None

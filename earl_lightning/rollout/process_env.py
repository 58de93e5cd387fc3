"""An environment in a worker process of its own, so that a call that never returns, even one that
holds the GIL (a long big-integer computation), can be ended by killing the process.

:class:`ProcessEnv` builds the environment in a fresh process (``forkserver``: not a fork of the
trainer, which holds threads and a model) and forwards ``reset``, ``step`` and the environment's
tools to it over a pipe; the rollout kills it when a call runs past ``env_timeout_s``
(``--model.rollout.call_isolation process``). The task's own tools (``--data.tools``) live in the
same process, or, for an episode without an environment, in a process of their own. Only the
environment's name, its keyword arguments, the task's tool functions (by reference: module-level
functions), the calls' arguments and their results cross the pipe, so they must pickle (YAML
settings, import paths and :class:`StepResult` do).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from earl_lightning.envs.base import StepResult
from earl_lightning.tasks.tools import Tool

_CONTEXT = None
_CONTEXT_LOCK = threading.Lock()


def _context():
    """The ``forkserver`` context, its server started (once per trainer process): it imports the
    project once, and each environment process then starts from it in milliseconds."""
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            from multiprocessing import forkserver

            ctx = mp.get_context("forkserver")
            # "__main__" too: the server imports the trainer's main module once (the `earl` command's
            # imports take seconds); a child then finds it loaded instead of importing it again.
            ctx.set_forkserver_preload(
                ["__main__", "earl_lightning.envs", "earl_lightning.rollout.process_env"]
            )
            forkserver.ensure_running()
            # returns once the server has imported them
            ready = ctx.Process(target=_ready, daemon=True)
            ready.start()
            ready.join()
            _CONTEXT = ctx
        return _CONTEXT


def _ready() -> None:  # pragma: no cover - runs in the child
    pass


def start_servers() -> None:
    """Start the process that forks environment processes, before any call is timed."""
    _context()


class RemoteError(Exception):
    """An exception the environment raised in its process (its type and message kept)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def check_picklable(tools: Sequence[Tool], arg: str = "--data.tools") -> None:
    """Raise ValueError, naming the tool, when a task tool's function cannot be sent to a worker
    process (a lambda, a closure, a bound method of an object that does not pickle)."""
    for tool in tools:
        try:
            pickle.dumps(tool.fn)
        except Exception as exc:  # noqa: BLE001 - pickle raises several types
            raise ValueError(
                f"`{arg}` tool {tool.name!r} cannot run in a worker process (`call_isolation: "
                f"process`): its function does not pickle ({type(exc).__name__}: {exc}); define it at "
                f"module level, or use `call_isolation: thread`"
            ) from None


class ProcessEnv:
    """An environment (``name``; None: none) and the task's ``tools`` living in a process of their
    own; the same calls as the environment itself, and :meth:`hosted` for the task's tools.

    Raises :class:`RemoteError` for an exception inside the environment, and ``EOFError`` once the
    process is gone (killed, or dead)."""

    def __init__(
        self, name: str | None, kwargs: dict[str, Any], tools: Sequence[Tool] = ()
    ) -> None:
        ctx = _context()
        self._conn, child = ctx.Pipe()
        task = {t.name: t.fn for t in tools}
        self._proc = ctx.Process(
            target=_serve,
            args=(child, name, kwargs, task),
            daemon=True,
            name=f"earl-env-{name or 'tools'}",
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._hosted = [Tool(t.schema, _Remote(self, t.name)) for t in tools]
        self._tools: list[Tool] = (
            []
            if name is None
            else [
                Tool(schema, _Remote(self, schema["function"]["name"]))
                for schema in self._call("__tools__")
            ]
        )

    def hosted(self) -> list[Tool]:
        """The task's tools, each call run in this process."""
        return list(self._hosted)

    def reset(self, seed: int, **columns: Any) -> Any:
        """The environment's reset, given the columns its own signature takes."""
        return self._call("reset", seed, **columns)

    def step(self, action: str) -> StepResult:
        return self._call("step", action)

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def kill(self) -> None:
        """End the process now (a call still running in it ends with it)."""
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # one call at a time per environment, as in-process
            self._conn.send((method, args, kwargs))
            status, value = self._conn.recv()
        if status == "raised":
            raise RemoteError(*value)
        return value


class _Remote:
    """A tool of the remote environment: calling it runs the method in the process."""

    def __init__(self, env: ProcessEnv, name: str) -> None:
        self.env, self.__name__ = env, name

    def __call__(self, **arguments: Any) -> Any:
        return self.env._call(self.__name__, **arguments)


def _serve(  # pragma: no cover - runs in the child
    conn: Any, name: str | None, kwargs: dict[str, Any], task: dict[str, Any]
) -> None:
    from earl_lightning.envs.base import ToolEnv, make_env
    from earl_lightning.tasks.rows import reset_kwargs
    from earl_lightning.tasks.tools import tool_of

    env, tools, failed = None, {}, None
    try:
        if name is not None:
            env = make_env(name, **kwargs)
            if isinstance(env, ToolEnv):
                tools = {t.name: t.fn for t in (tool_of(x, "tools") for x in env.tools())}
    except Exception as exc:  # noqa: BLE001 - reported to the parent as the first call's failure
        failed = exc
    own = list(tools)
    tools = {**task, **tools}
    while True:
        try:
            method, args, kw = conn.recv()
        except EOFError:
            return
        try:
            if failed is not None:
                raise failed
            if method == "__tools__":
                value = [tool_of(tools[n], "tools").schema for n in own]
            elif method == "reset":  # the row's columns its reset takes (they all crossed the pipe)
                value = env.reset(*args, **reset_kwargs(env.reset, kw))
            elif method == "step":
                value = env.step(*args)
            else:
                value = tools[method](*args, **kw)
            conn.send(("ok", value))
        except Exception as exc:  # noqa: BLE001 - the environment's own failure, sent back
            conn.send(
                ("raised", (f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)[:500]))
            )


def remote_owner(fn: Any) -> ProcessEnv | None:
    """The :class:`ProcessEnv` a tool's function runs in (None: it runs in this process)."""
    return fn.env if isinstance(fn, _Remote) else None

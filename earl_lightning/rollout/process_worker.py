"""The entry module of a worker process (``call_isolation: process``): it hosts environments and
runs tool calls for :mod:`earl_lightning.rollout.process_env`, one request at a time.

Started as ``python -m earl_lightning.rollout.process_worker FD PARENT_PID``, never by re-running
the trainer's command: it imports the environments and the task helpers (``earl_lightning.envs``,
``earl_lightning.tasks``) and, as a request names them, the user's environment and tool modules by
import path, never the CLI, Lightning, torch or the model, so it is ready in a fraction of a second.

It dies with the trainer: the kernel sends it SIGKILL when the thread that started it ends (Linux's
``PR_SET_PDEATHSIG``; the trainer starts workers from one thread that lives as long as the
process), even in a call that holds the GIL; elsewhere it exits at the end of its pipe. It ignores
SIGINT: a ctrl-C in the terminal is the trainer's to handle, which then ends its workers.

The protocol, over one socket (``multiprocessing.connection``): the trainer sends its ``sys.path``,
the worker answers ``("ready", pid)``; then each request is ``(op, key, payload)`` with the payload
pickled on its own (so that a module that fails to import is the call's error, not the worker's
end), and each answer (none for ``drop``) the pickled ``("ok", value)`` or ``("raised", (type,
message))``. ``key`` names an environment the worker holds: ``make`` builds it (and answers its tools'
schemas), ``reset``, ``step`` and ``tool`` call it, ``drop`` forgets it; ``call`` runs one of the
task's own tool functions, which the payload carries by reference.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import sys
from typing import Any


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - runs in the worker
    fd, parent = (int(a) for a in (argv if argv is not None else sys.argv[1:]))
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    sys.path[:] = conn.recv()
    import earl_lightning.envs  # noqa: F401 - the built-in environments, registered once
    import earl_lightning.tasks.rows  # noqa: F401
    import earl_lightning.tasks.tools  # noqa: F401

    conn.send(("ready", os.getpid()))
    Host().serve(conn)


def _die_with(parent: int) -> None:  # pragma: no cover - runs in the worker
    """Ask the kernel for SIGKILL when the trainer goes (Linux), and go now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


class Host:
    """The environments of one worker process, by key, and the calls into them."""

    def __init__(self) -> None:
        self.envs: dict[int, Any] = {}
        self.tools: dict[int, dict[str, Any]] = {}  # key -> the environment's own tools by name
        self.loop: asyncio.AbstractEventLoop | None = None

    def serve(self, conn: Any) -> None:  # pragma: no cover - runs in the worker
        while True:
            try:
                op, key, payload = conn.recv()
            except EOFError:
                return
            if op == "drop":
                self.envs.pop(key, None)
                self.tools.pop(key, None)
                continue
            conn.send_bytes(self.answer(op, key, payload))

    def answer(self, op: str, key: int, payload: bytes) -> bytes:
        """The pickled outcome of one request."""
        try:
            value = self.awaited(self.run(op, key, pickle.loads(payload)))
            return pickle.dumps(("ok", value))
        except Exception as exc:  # noqa: BLE001 - the environment's or tool's own failure, sent back
            kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
            return pickle.dumps(("raised", (kind, str(exc)[:500])))

    def run(self, op: str, key: int, args: tuple) -> Any:
        from earl_lightning.tasks.rows import reset_kwargs

        if op == "load":  # unpickling the payload imported the modules; the rest of ours too
            import earl_lightning.envs.base  # noqa: F401
            import earl_lightning.tasks.tools  # noqa: F401

            return None
        if op == "make":
            return self.make(key, *args)
        if op == "call":  # a task tool: (function, arguments)
            fn, kwargs = args
            return fn(**kwargs)
        env = self.envs[key]
        if op == "reset":  # the row's columns its reset takes (they all crossed the pipe)
            seed, columns = args
            return env.reset(seed, **reset_kwargs(env.reset, columns))
        if op == "step":
            return env.step(*args)
        if op == "tool":
            name, kwargs = args
            return self.tools[key][name](**kwargs)
        raise ValueError(f"unknown request {op!r}")

    def make(self, key: int, name: str, kwargs: dict[str, Any], _factory: Any) -> list[dict]:
        """Build the environment (``_factory``, by reference, was unpickled first: its module is
        imported, and a name it registers resolves); the schemas of the tools it offers."""
        from earl_lightning.envs.base import ToolEnv, make_env
        from earl_lightning.tasks.tools import tool_of

        env = make_env(name, **kwargs)
        tools = [tool_of(t, "tools") for t in env.tools()] if isinstance(env, ToolEnv) else []
        self.envs[key], self.tools[key] = env, {t.name: t.fn for t in tools}
        return [t.schema for t in tools]

    def awaited(self, value: Any) -> Any:
        """An ``async def`` method's or tool's result, run on this worker's event loop."""
        if not inspect.isawaitable(value):
            return value
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(_await(value))


async def _await(value: Any) -> Any:
    return await value


if __name__ == "__main__":  # pragma: no cover
    main()

"""Run the ``earl`` command in a process of its own, as a user's shell would, without paying the
interpreter's imports each time.

``run_earl_process(argv, env=..., cwd=..., timeout=...)`` is ``subprocess.run([earl, *argv],
capture_output=True, text=True, ...)``: a ``CompletedProcess`` with the exit code, stdout and
stderr. The process is forked from the fork server of :mod:`tests.distributed.launch`, which has
imported torch, Lightning, transformers and the package once; an ``earl`` process otherwise spends
7-9 s of CPU importing them, most of a short test's time on 2 cores. The child then becomes the
``earl`` command: its own session (so ``killpg`` reaches the ranks it launches), the given
working directory, environment, ``sys.argv`` and ``sys.path`` (the script's directory, then
``PYTHONPATH``, then the interpreter's own), stdin/stdout/stderr on files, ``torch``'s thread count
from ``OMP_NUM_THREADS`` (read by OpenMP when torch was imported) and the temporary directory from
``TMPDIR`` (``tempfile`` caches it), its ``atexit`` functions run before it exits with ``main()``'s
code. Ranks the run launches (``--trainer.devices 2``) are Lightning's own subprocesses of it, as
in a shell.

What stays a real subprocess: tests of signals and process trees (ctrl-C, killed ranks, worker
pools), of start-up itself, and of streaming output. ``EARL_TEST_REAL_PROCESS=1`` runs every
``run_earl_process`` as a real subprocess too: the same suite, to check the two agree.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

EARL = Path(sys.executable).with_name("earl")
REAL_PROCESS_ENV = "EARL_TEST_REAL_PROCESS"


def run_earl_process(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    input: str | bytes | None = None,
    check: bool = False,
    capture_output: bool = False,
    text: bool = False,
    stdout: int | None = None,
    stderr: int | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` for ``cmd = [EARL, *argv]``, with the same arguments and result:
    ``capture_output`` or ``subprocess.PIPE`` give the output (``text``: decoded, universal
    newlines), ``subprocess.DEVNULL`` drops it, ``None`` passes it to this process's streams.

    Raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds (after killing the process and
    every process of its session) and, with ``check``, ``subprocess.CalledProcessError``."""
    cmd = [str(part) for part in cmd]
    if cmd[0] != str(EARL):
        raise ValueError(f"run_earl_process runs {EARL}, not {cmd[0]!r}")
    environ = dict(os.environ if env is None else env)
    where = str(cwd if cwd is not None else os.getcwd())
    if capture_output:
        stdout = stderr = subprocess.PIPE
    if os.environ.get(REAL_PROCESS_ENV) == "1":
        return subprocess.run(
            cmd, env=environ, cwd=where, input=input, check=check, text=text, stdout=stdout,
            stderr=stderr, timeout=timeout,
        )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="earl-run-") as tmp:
        paths = [Path(tmp, name) for name in ("stdin", "stdout", "stderr")]
        if isinstance(input, bytes):
            paths[0].write_bytes(input)
        else:
            paths[0].write_text(input or "")
        for path in paths[1:]:
            path.touch()
        code = _forked(cmd, environ, where, [str(p) for p in paths], timeout)
        out, err = (_output(path, how, text) for path, how in zip(paths[1:], (stdout, stderr)))
    for data, stream, how in ((out, sys.stdout, stdout), (err, sys.stderr, stderr)):
        if how is None:
            stream.write(data)
    out, err = (
        data if how == subprocess.PIPE else None for data, how in ((out, stdout), (err, stderr))
    )
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout or 0.0, output=out, stderr=err)
    if check and code != 0:
        raise subprocess.CalledProcessError(code, cmd, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, code, out, err)


def _output(path: Path, how: int | None, text: bool) -> str | bytes:
    """What the child wrote to ``path``: text (universal newlines, as ``text=True`` reads a pipe)
    where it is passed on or ``text`` asks for it, else bytes."""
    if how is None or text:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    return path.read_bytes()


def _forked(
    cmd: list[str], env: dict[str, str], cwd: str, paths: list[str], timeout: float | None
) -> int | None:
    """The exit code of ``cmd`` run in a child of the fork server, or None when it ran past
    ``timeout`` (its session is then killed)."""
    from tests.distributed.launch import _context

    proc = _context().Process(
        target=_become_earl, args=(cmd, env, cwd, paths, _interpreter_path()), name="earl"
    )
    proc.start()
    timed_out = False
    try:
        proc.join(timeout)
        timed_out = proc.exitcode is None
    finally:
        if proc.exitcode is None:  # past the timeout, or the test was interrupted
            _kill_session(proc.pid)
            proc.join()
    return None if timed_out else proc.exitcode


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@functools.cache
def _interpreter_path() -> list[str]:
    """``sys.path`` of this interpreter run with no ``PYTHONPATH`` (its standard library and
    site-packages, with the editable install's entries), without the script's directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.check_output(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        env=env,
        cwd=tempfile.gettempdir(),
        text=True,
    )
    return json.loads(out)


def _become_earl(
    cmd: list[str], env: dict[str, str], cwd: str, paths: list[str], interpreter_path: list[str]
) -> None:
    """In the forked child: become ``earl`` as a shell would start it, run it, exit with its code."""
    os.setsid()
    for fd, (path, flags) in enumerate(zip(paths, (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY))):
        target = os.open(path, flags)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 outlives this function
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read from TMPDIR on first use, and the server has used it
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(Path(cmd[0]).parent), *extra, *interpreter_path]
    sys.argv[:] = cmd
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    from earl_lightning.cli import main

    code: object = 0
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code
    finally:
        atexit._run_exitfuncs()
    raise SystemExit(code)

"""tests/earl_process.py's forked ``earl`` behaves as the real command does: the same exit code,
stdout and stderr, the working directory, ``PYTHONPATH`` and ``TMPDIR`` of the call, its own
session, and ``TimeoutExpired`` past the timeout."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.distributed.launch import subprocess_env
from tests.earl_process import EARL, run_earl_process

RECIPE = Path(__file__).parents[2] / "recipes" / "connect4_grpo.yaml"


def _both(argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, ...]:
    cmd = [str(EARL), *argv]
    real = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    forked = run_earl_process(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    return real, forked


def test_help_and_a_bad_argument_read_the_same_as_the_real_command(tmp_path):
    for argv in (["--help"], ["presets", "earl-tiny-2"]):
        real, forked = _both(argv, env=subprocess_env(), cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            real.returncode,
            real.stdout,
            real.stderr,
        ), argv
    assert real.returncode == 2 and "unknown preset 'earl-tiny-2'" in real.stderr


def test_the_calls_directory_path_and_temporary_directory_are_the_commands(tmp_path):
    """A callback module found through ``PYTHONPATH`` (imported while the arguments are parsed)
    reports the working directory, ``tempfile``'s directory, ``sys.argv`` and ``sys.path[0]``
    from inside the run, and exits 3: the same in the real command and the forked one, which also
    leads a session of its own."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "where_am_i.py").write_text(
        textwrap.dedent(
            """
            import json, os, sys, tempfile
            with open(os.environ["WHERE_OUT"], "w") as f:
                json.dump({"cwd": os.getcwd(), "tmp": tempfile.gettempdir(), "argv": sys.argv,
                           "path0": sys.path[0], "plugin": os.environ["PYTHONPATH"] in sys.path,
                           "session": os.getsid(0) == os.getpid()}, f)
            raise SystemExit(3)
            """
        )
    )
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    argv = ["fit", "--config", str(RECIPE), "--trainer.callbacks+=where_am_i.Probe"]
    seen = []
    for side, run in (("real", subprocess.run), ("forked", run_earl_process)):
        out = tmp_path / f"{side}.json"
        env = subprocess_env(PYTHONPATH=str(plugin), TMPDIR=str(tmp), WHERE_OUT=str(out))
        proc = run(
            [str(EARL), *argv], env=env, cwd=work, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 3, proc.stderr[-2000:]
        seen.append(json.loads(out.read_text()))
    real, forked = seen
    assert forked.pop("session") and not real.pop("session")
    assert forked == real
    assert real == {
        "cwd": str(work),
        "tmp": str(tmp),
        "argv": [str(EARL), *argv],
        "path0": str(EARL.parent),
        "plugin": True,
    }


def test_a_run_past_its_timeout_raises_timeout_expired(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_earl_process(
            [str(EARL), "fit", "--config", str(tmp_path / "missing.yaml")],
            env=subprocess_env(),
            timeout=0.01,
            capture_output=True,
        )

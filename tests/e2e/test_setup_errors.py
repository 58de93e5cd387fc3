"""Errors the `earl` command finds before training starts are one line on stderr and exit 2; an
environment whose reset raises is named with where it raised, not with a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]


def test_an_env_whose_reset_raises_is_one_line_naming_where(tmp_path):
    earl = Path(sys.executable).with_name("earl")
    proc = run_earl_process(
        [
            str(earl),
            "fit",
            "--config",
            str(ROOT / "recipes" / "connect4_grpo.yaml"),
            "--data.env",
            "tests.plugins.faulty_envs.RaisesInReset",
            "--data.env_kwargs",
            "{num_turns: 3, padding_chars: 4}",
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith(
        "earl: error: `--data.env` 'tests.plugins.faulty_envs.RaisesInReset': env "
        "'tests.plugins.faulty_envs.RaisesInReset' (seed "
    ), lines[-1]
    assert "reset() raised OSError('reset broke') (at " in lines[-1]
    assert lines[-1].endswith(f"{ROOT / 'tests' / 'plugins' / 'faulty_envs.py'}:43)"), lines[-1]

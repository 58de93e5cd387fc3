"""``--model.rollout.backend`` through the real ``earl fit`` command: a bad name is one line that
lists the registered generation backends (exit 2, no traceback); a user's own backend, named by
import path (its module registers it), runs the training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "connect4_grpo.yaml"
EARL = Path(sys.executable).with_name("earl")


def earl_fit(root: Path, *argv: str) -> subprocess.CompletedProcess:
    return run_earl_process(
        [
            str(EARL),
            "fit",
            "--config",
            str(RECIPE),
            "--trainer.default_root_dir",
            str(root),
            "--trainer.enable_progress_bar",
            "false",
            *argv,
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        timeout=600,
    )


def test_a_bad_backend_name_is_one_line_listing_the_registered_ones(tmp_path):
    proc = earl_fit(tmp_path, "--model.rollout.backend", "trt")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = (
        "earl: error: unknown `--model.rollout.backend` 'trt'; valid generation backends: "
        "['hf', 'vllm'], or an import path such as `my_package.module.Name`"
    )
    assert proc.stderr.splitlines()[-1] == line
    assert [s for s in proc.stderr.splitlines() if s.startswith("earl:")] == [line]


def test_a_user_backend_named_by_import_path_trains(tmp_path):
    proc = earl_fit(
        tmp_path,
        "--model.rollout.backend",
        "tests.plugins.backends.counting_hf",
        "--trainer.max_steps",
        "1",
        "--trainer.val_check_interval",
        "1",
        "--data.batch_size",
        "4",
        "--data.group_size",
        "2",
        "--data.eval_episodes",
        "2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "counting_hf: built" in proc.stdout

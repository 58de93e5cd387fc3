"""A peer lost outside the RL stages, on 2 gloo processes under EarlStrategy with DCP checkpoints
(`recipes/connect4_grpo_layouts.yaml`, 4 small steps, a checkpoint after each): rank 1 is stopped
(SIGSTOP: alive but silent) or killed at the end of step 2, before its checkpoint is saved, so
rank 0 next waits in the save's collectives. Rank 0 must stop within the 10 s collective timeout
with one line (no traceback) and a nonzero exit, killing the stopped rank it launched; the last
checkpoint (step 1) stays whole and `--ckpt_path last` continues from it to the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.distributed.launch import subprocess_env
from tests.e2e.test_scale_out import EARL, RECIPE, ROOT, overrides
from tests.earl_process import run_earl_process

pytestmark = pytest.mark.distributed
TIMEOUT_S = 10
STEPS = 3


def fit_command(run: Path, *extra: str) -> list[str]:
    """``earl fit`` of the recipe in ``run``, ``STEPS`` steps."""
    return [
        str(EARL),
        "fit",
        "--config",
        str(RECIPE),
        "--config",
        str(overrides(run)),
        "--trainer.max_steps",
        str(STEPS),
        "--trainer.strategy.collective_timeout_s",
        str(TIMEOUT_S),
        *extra,
    ]


def fit_env() -> dict[str, str]:
    """The environment of this module's ``earl fit`` runs: the repository importable, one torch
    thread."""
    return subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def captured() -> dict:
    """How a run whose stderr is read back is called, forked or as a real process."""
    return dict(
        env=fit_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )


def earl_fit(run: Path, *extra: str, name: str) -> tuple[int, str]:
    """``earl fit`` of the recipe in ``run`` as a real process (exit code, stderr): the faults'
    runs, where rank 0 must stop and kill the rank it launched. Output goes to files: a stopped
    rank holds the pipes it inherited open, and a reader of pipes would wait for it forever."""
    cmd = fit_command(run, *extra)
    err = run / f"{name}.err"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            cmd,
            env=fit_env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return code, err.read_text()


def fault(run: Path, sig: str) -> tuple[int, str, float, int]:
    """Run with ``sig`` sent to rank 1 at the end of step 2: (exit code, stderr, seconds from the
    signal to rank 0's exit, rank 1's pid)."""
    marker = run / "fault.marker"
    code, err = earl_fit(
        run,
        "--trainer.callbacks+=tests.plugins.faults.KillRank",
        "--trainer.callbacks.step",
        "2",
        "--trainer.callbacks.marker",
        str(marker),
        "--trainer.callbacks.sig",
        sig,
        "--trainer.callbacks.at",
        "end",
        name="fault",
    )
    ended = time.time()
    assert marker.exists(), err[-3000:]
    return code, err, ended - marker.stat().st_mtime, int(marker.read_text().split("pid ")[1])


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("earl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting for its parent counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def assert_whole(ckpt: Path, step: int) -> None:
    """``ckpt`` is a complete DCP checkpoint of ``step``: every shard reads back."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert torch.load(ckpt / "meta.pt", weights_only=True)["global_step"] == step
    dcp_to_torch_save(ckpt, ckpt.parent / "whole.pt")
    assert torch.load(ckpt.parent / "whole.pt", weights_only=False)["state_dict"]


def test_a_stopped_rank_stops_the_survivor_in_one_line_and_the_run_resumes(tmp_path):
    code, err, waited, stopped = fault(tmp_path, "SIGSTOP")
    try:
        assert code == 1 and waited < TIMEOUT_S + 25, (code, waited, err[-3000:])
        line = one_line(err)
        assert line.startswith("earl: error: rank 0 lost a peer during the strategy's ")
        assert "in on_train_batch_end of global step 2: another process stopped answering" in line
        last = tmp_path / "checkpoints" / "last.ckpt"
        assert f"resume from {last} (`--ckpt_path last`)" in line
        assert gone(stopped)  # rank 0 killed the rank it had launched
    finally:
        if not gone(stopped):
            os.kill(stopped, signal.SIGKILL)  # a stopped process takes SIGKILL at once
    assert_whole(last, step=1)
    # the resume is no fault's run: forked (tests/earl_process.py), no interpreter to start
    proc = run_earl_process(fit_command(tmp_path, "--ckpt_path", "last"), **captured())
    code, err = proc.returncode, proc.stderr
    assert code == 0, err[-3000:]
    assert f"Restored all states from the checkpoint at {last}" in err
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == STEPS


def test_a_killed_rank_during_a_checkpoint_save_stops_the_survivor_in_one_line(tmp_path):
    code, err, waited, _ = fault(tmp_path, "SIGKILL")
    assert code == 1 and waited < 25, (
        code,
        waited,
        err[-3000:],
    )  # gloo notices a dead peer at once
    line = one_line(err)
    assert "in on_train_batch_end of global step 2: another process died (RuntimeError: " in line
    assert_whole(tmp_path / "checkpoints" / "last.ckpt", step=1)


def test_a_killed_rank_under_strategy_auto_is_one_line_too(tmp_path):
    """``strategy: auto`` on 2 processes is Lightning's DDP; the CLI gives it the same one-line
    collectives (``OneLineDDPStrategy``): rank 1 killed at the end of step 2, rank 0 stops in the
    checkpoint save's collectives with one line, and step 1's checkpoint loads. Rank 0 takes 8 s
    more to end (a loaded machine): Lightning's watch over the rank it started would have killed it
    within 5 s (exit -9, no line); the launcher gives it LOST_PEER_GRACE_S."""
    recipe = ROOT / "recipes" / "connect4_grpo.yaml"
    marker = tmp_path / "fault.marker"
    over = tmp_path / "over.yaml"
    over.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "devices": 2,
                    "max_steps": STEPS,
                    "limit_val_batches": 0,
                    "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path),
                    "callbacks": [
                        {
                            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                            "init_args": {
                                "dirpath": str(tmp_path / "checkpoints"),
                                "save_last": True,
                                "every_n_train_steps": 1,
                            },
                        },
                        {
                            "class_path": "tests.plugins.faults.KillRank",
                            "init_args": {
                                "step": 2,
                                "marker": str(marker),
                                "at": "end",
                                "linger_s": 8.0,
                            },
                        },
                    ],
                },
                "data": {"batch_size": 8, "group_size": 4, "eval_episodes": 0},
            }
        )
    )
    cmd = [
        str(Path(sys.executable).with_name("earl")),
        "fit",
        "--config",
        str(recipe),
        "--config",
        str(over),
    ]
    proc = subprocess.run(cmd, **captured())
    assert proc.returncode == 1 and marker.exists(), proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith("earl: error: rank 0 lost a peer during the strategy's ")
    assert "of global step 2: another process died" in line
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"resume from {last}" in line
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 1

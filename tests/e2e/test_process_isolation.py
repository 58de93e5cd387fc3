"""``call_isolation: process`` through the real ``earl`` command: a fit plays in a bounded pool of
worker processes, reused across episodes and steps, and leaves no process behind, whether it ends,
is stopped with ctrl-C or is killed; ``earl sft`` refuses a tool that cannot reach a worker in one
line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.distributed.launch import subprocess_env
from tests.e2e.test_multiprocess import scalars
from tests.earl_process import run_earl_process
from tests.plugins.workers import alive

ROOT = Path(__file__).resolve().parents[2]
EARL = str(Path(sys.executable).with_name("earl"))
RECIPE = ROOT / "recipes" / "calculator_ppo.yaml"


def fit_args(root: Path, env: str, env_kwargs: dict, *extra: str) -> list[str]:
    """Two steps of the calculator PPO recipe (which sets ``call_isolation: process``) on ``env``,
    8 episodes a step, 2 call workers: a pool of at most 2 processes."""
    return [
        EARL,
        "fit",
        "--config",
        str(RECIPE),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "4",
        "--data.env",
        env,
        "--data.env_kwargs",
        yaml.safe_dump(env_kwargs, default_flow_style=True).strip(),
        "--model.rollout.call_workers",
        "2",
        *extra,
    ]


def test_the_calculator_recipe_fits_in_a_bounded_pool_of_worker_processes(tmp_path):
    """Before the pool, each episode's environment had a process of its own, started by a fork
    server that imported the whole `earl` command again (~11 s each): 16 training episodes and the
    evaluation's, each in a fresh process. Now at most 2 workers play all of them, none is the
    trainer, and none outlives the run."""
    assert yaml.safe_load(RECIPE.read_text())["model"]["rollout"]["call_isolation"] == "process"
    pids = tmp_path / "pids"
    pids.mkdir()
    kwargs = {"difficulty": "easy", "max_tool_calls": 3, "pid_dir": str(pids)}
    proc = subprocess.Popen(
        fit_args(tmp_path / "run", "tests.plugins.workers.PidCalculator", kwargs),
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    logged = scalars(tmp_path / "run")
    assert len(logged["reward/mean"]) == 2 and logged["env/errors"] == [0.0, 0.0]
    assert "val/reward" in logged
    where = {
        tuple(int(x) for x in f.name.split("-")): f.read_text().split() for f in pids.iterdir()
    }
    # the set-up check of the first prompt (check_first_observation, when the command starts and
    # in setup) resets the first episode's env in the trainer itself; every episode plays in a worker
    assert len({s for (pid, _), seeds in where.items() if pid == proc.pid for s in seeds}) <= 1
    played = {k: seeds for k, seeds in where.items() if k[0] != proc.pid}
    workers = {pid for pid, _ in played}
    resets = sum(len(seeds) for seeds in played.values())
    assert 1 <= len(workers) <= 2 < 16 <= resets, (workers, resets)
    assert {parent for _, parent in played} == {proc.pid}, "the trainer started every worker"
    assert not any(alive(p) for p in workers), "a worker outlived the run"


def gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture
def hung(tmp_path):
    """An `earl fit` whose every step holds the GIL in its worker for minutes (no time limit), and
    the pids of the workers, once some are inside such a call. Whatever the test's outcome, even a
    start that never got there, the run's process group and its workers are killed at the end (a
    run left hanging would spin its workers through the rest of the suite)."""
    marker = tmp_path / "hung"
    marker.mkdir()
    proc = subprocess.Popen(
        fit_args(
            tmp_path / "run",
            "tests.plugins.workers.Where",
            {"always_hang": True, "marker": str(marker)},
            "--model.rollout.env_timeout_s",
            "null",
        ),
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a terminal's ctrl-C reaches all of it
    )
    try:
        deadline = time.monotonic() + 300
        while not any(marker.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-4000:]
            time.sleep(0.5)
        time.sleep(1.0)  # the other worker too, most likely
        yield proc, [int(f.name) for f in marker.iterdir()]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for f in marker.iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(f.name), signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_killed_trainer_leaves_no_worker_even_one_holding_the_gil(hung):
    proc, workers = hung
    assert all(alive(p) for p in workers)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    assert gone(workers, within_s=10), "a worker outlived the killed trainer"


def test_ctrl_c_ends_the_run_and_its_workers(hung):
    """SIGINT to the whole process group, as a terminal sends it: the workers ignore it (no
    KeyboardInterrupt traceback of theirs), the trainer stops and ends them (failed once: the kernel
    handed the signal to another thread of the trainer, whose main thread waited on the hung calls
    with no timeout and never ran the handler; tests/unit/test_deadline.py pins the fix)."""
    proc, workers = hung
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert gone(workers, within_s=10), "a worker outlived the interrupted run"
    assert "process_worker" not in stderr, stderr[-4000:]


def test_earl_sft_refuses_a_tool_that_cannot_reach_a_worker_in_one_line(tmp_path):
    """A refusal made before any worker starts: the command's exit code and output, not its process
    tree, so a forked `earl` (tests/earl_process.py) reads it as a fresh one does."""
    proc = run_earl_process(
        [
            EARL,
            "sft",
            "--config",
            str(ROOT / "recipes" / "calculator_sft.yaml"),
            "--model.rollout.call_isolation",
            "process",
            "--data.tools",
            "[tests.plugins.workers.twice]",
            "--data.num_episodes",
            "4",
            "--output_dir",
            str(tmp_path / "model"),
        ],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "earl: error: `--data.tools` tool 'twice' cannot run in a worker process "
        "(`call_isolation: process`): its function does not pickle (AttributeError: Can't pickle "
        "local object '_closure.<locals>.twice'); define it at module level in an importable "
        "module, or use `call_isolation: thread`"
    )
    assert not (tmp_path / "model").exists()

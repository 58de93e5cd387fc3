"""Scale-out and faults under EarlStrategy with DCP checkpoints, on 2 gloo processes, with a rollout
layout (tp=2) other than the train layout (dp=2) — `recipes/connect4_grpo_layouts.yaml`:

- a 2-"node" job (two torchrun launches on 127.0.0.1, ``--nnodes 2``, one process each; or the two
  tasks ``srun --nodes 2 --ntasks-per-node 1`` starts, with the SLURM variables srun gives each,
  through Lightning's SLURM environment) equals the same job on one node, bit for bit (parameters
  and per-step metrics);
- a rank SIGKILLed mid-run ends the round; ``torchrun --max-restarts 1`` starts another, which with
  ``--ckpt_path last`` resumes from the last checkpoint and ends bit-identical to the uninterrupted run;
- without a restart, the surviving rank stops within the collective timeout + 30 s with one line
  naming the stage and step and the checkpoint to resume from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from earl_lightning.parallel.launch_env import free_port
from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process
from tests.load import load_repo_file

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "connect4_grpo_layouts.yaml"
EARL = Path(sys.executable).with_name("earl")
# 4 steps: the killed rank's restart resumes from step 2's checkpoint (neither the first nor the
# last) and runs 2 more steps, which must then equal the uninterrupted run's.
STEPS = 4
pytestmark = pytest.mark.distributed


def overrides(run: Path) -> Path:
    """Small batches, a checkpoint after every step in a fixed directory (a restarted run's new
    logger version must find the last one)."""
    path = run / "over.yaml"
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "max_steps": STEPS,
                    "limit_val_batches": 0,
                    "enable_progress_bar": False,
                    "log_every_n_steps": 1,
                    "default_root_dir": str(run),
                    "callbacks": [
                        {
                            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                            "init_args": {
                                "dirpath": str(run / "checkpoints"),
                                "save_last": True,
                                "every_n_train_steps": 1,
                            },
                        }
                    ],
                },
                "data": {"batch_size": 8, "group_size": 4, "eval_episodes": 0},
            }
        )
    )
    return path


# One intra-op thread in every process of every launch: torchrun sets it for several processes per
# node and not for one, and a process with two threads splits its matmuls' reductions otherwise
# (measured on a 2-core machine: 2 nodes x 1 process then differed from 1 x 2 by 1.6e-7).
ONE_THREAD = "1"


def torchrun(
    run: Path, *launch: str, extra: tuple[str, ...] = (), forked: bool = False
) -> subprocess.Popen | ForkedTorchrun:
    """``torchrun LAUNCH -m earl_lightning.cli fit ...`` in its own session (a launch that outlives
    the test is killed with everything it started), its output in ``run / "launchN.log"``.
    ``forked``: torchrun itself forked from the tests' fork server (``tests/earl_process.py``), not
    a new interpreter; the ranks it starts are real processes either way."""
    args = [*launch, "-m", "earl_lightning.cli", "fit", "--config", str(RECIPE)]
    args += ["--config", str(overrides(run)), *extra]
    log = run / f"launch{len(list(run.glob('launch*.log')))}.log"
    env = subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=ONE_THREAD)
    if forked:
        log.touch()  # the next launch's log is numbered after it
        return ForkedTorchrun(args, env, log)
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("torchrun")), *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )
    proc.log = log
    return proc


class ForkedTorchrun:
    """A torchrun launch forked from the fork server, waited on as a ``Popen`` is: the 2-node
    tests are about the launches' rendezvous, not torchrun's start-up (~2 s of CPU each)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        from tests.distributed.launch import _context

        self.log = log
        self.proc = _context().Process(target=_become_torchrun, args=(args, env, str(log)))
        self.proc.start()
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("torchrun", timeout)
        return self.proc.exitcode


def _become_torchrun(args: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: ``torchrun ARGS`` as a shell would start it in ``ROOT``."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd in (1, 2):
        os.dup2(out, fd)
    os.close(out)
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    sys.argv[:] = [str(Path(sys.executable).with_name("torchrun")), *args]
    from torch.distributed.run import main

    main()


def finish(*procs: subprocess.Popen | ForkedTorchrun, timeout: float = 300) -> None:
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0, p.log.read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


# the last DCP checkpoint's parameters and every per-step scalar, read as the chaos run reads them
final_state = load_repo_file("scripts/chaos.py", "chaos").final_state


def assert_same_run(a: Path, b: Path, steps: int = STEPS) -> None:
    pa, sa = final_state(a)
    pb, sb = final_state(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=0, atol=0, msg=f"parameter {k}")
    for tag in (
        "reward/mean",
        "loss/policy",
        "grad_norm",
        "context/mean",
        "logprob/mismatch",
        "dispatch/bytes",
    ):
        assert sb[tag] == sa[tag] and len(sa[tag]) == steps, tag


def earl_fit(run: Path, *extra: str, env: dict[str, str] | None = None, name: str = "earl") -> Path:
    """``earl fit`` of the recipe in ``run`` (Lightning launches the other ranks of
    ``--trainer.devices`` on this node, or ``env``'s SLURM variables place it), forked as
    ``tests/earl_process.py`` does: its stdout and stderr in ``run / f"{name}.log"``, which it
    returns; it must exit 0."""
    over = run / "over.yaml"  # SLURM's two tasks share one, written before they start
    cmd = [EARL, "fit", "--config", RECIPE, "--config", over if over.exists() else overrides(run)]
    cmd += extra
    proc = run_earl_process(
        cmd,
        env=env or subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=ONE_THREAD),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    log = run / f"{name}.log"
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return log


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The reference: the recipe's 2 processes on one node, as a user starts them (``earl fit``:
    Lightning starts rank 1; no torchrun and its interpreter to pay for)."""
    run = tmp_path_factory.mktemp("one_node")
    earl_fit(run)
    return run


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_equal_one_node(one_node, tmp_path, rendezvous):
    port = free_port()
    if rendezvous == "static":
        launch = [
            ["--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            for r in (0, 1)
        ]
    else:  # elastic rendezvous: the nodes agree on their ranks through a c10d store
        launch = [
            [
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "scale-out",
            ]
        ] * 2
    nodes = [
        torchrun(
            tmp_path,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            *node,
            extra=("--trainer.num_nodes", "2", "--trainer.devices", "1"),
            forked=True,
        )
        for node in launch
    ]
    finish(*nodes)
    assert_same_run(one_node, tmp_path)


FOUR = (
    "--trainer.strategy.layouts",
    '{"rollout": {"dp": 2, "tp": 2}, "experience": {"dp": 4, "tp": 1}, '
    '"train": {"dp": 2, "tp": 2}}',
    "--trainer.max_steps",
    "2",
)


def test_two_nodes_of_two_equal_one_node_of_four(tmp_path):
    """2 x 2 = 4 processes: train tp=2 x FSDP dp=2, rollout dp=2 x tp=2 and experience dp=4, each TP
    group inside a node; two torchrun launches (``--nnodes 2 --nproc-per-node 2``) equal one
    ``earl fit --trainer.devices 4`` on one node, bit for bit (2 steps)."""
    one, two = tmp_path / "one", tmp_path / "two"
    earl_fit(one, *FOUR, "--trainer.devices", "4")  # one node: Lightning starts ranks 1-3
    port = free_port()
    nodes = [
        torchrun(
            two,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(r),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            extra=(*FOUR, "--trainer.num_nodes", "2", "--trainer.devices", "2"),
            forked=True,
        )
        for r in (0, 1)
    ]
    finish(*nodes)
    assert_same_run(one, two, steps=2)


def srun_task(run: Path, rank: int, port: int) -> Path:
    """One task of ``srun --nodes 2 --ntasks-per-node 1 earl fit ...``: the command with the
    variables srun gives it (no torchrun; Lightning's SLURMEnvironment reads them); its log."""
    slurm = dict(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="earl",
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NODELIST="127.0.0.1",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(rank),
        MASTER_PORT=str(port),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=ONE_THREAD,
    )
    return earl_fit(
        run,
        "--trainer.num_nodes",
        "2",
        "--trainer.devices",
        "1",
        env=subprocess_env(**slurm),
        name=f"srun{rank}",
    )


def test_two_slurm_nodes_equal_one_node(one_node, tmp_path):
    port = free_port()
    overrides(tmp_path)  # written once, before the two tasks read it
    with ThreadPoolExecutor(2) as tasks:  # the two tasks at once: they meet in the process group
        logs = list(tasks.map(lambda rank: srun_task(tmp_path, rank, port), (0, 1)))
    for rank, log in enumerate(logs):
        # ranks from SLURM_PROCID (no RANK is set), under Lightning's SLURM environment
        text = log.read_text()
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in text
        assert "SLURM auto-requeueing enabled" in text
    assert_same_run(one_node, tmp_path)


def test_killed_rank_restarts_and_resumes_bit_identical(one_node, tmp_path):
    """``torchrun --max-restarts 1`` with ``--ckpt_path last`` from the start (the first round finds
    no checkpoint and starts from the beginning): rank 1 is SIGKILLed after step 2, torchrun stops
    the survivor and starts a second round, which resumes from the last checkpoint (step 2's) and
    ends as if nothing had happened. (The second round used to hang or fail in ``init_process_group`` now and
    then — it read the dead round's addresses from torchrun's store; EarlStrategy now keys each
    round's rendezvous apart.)"""
    marker = tmp_path / "killed.marker"
    run = torchrun(
        tmp_path,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        extra=(
            "--ckpt_path",
            "last",
            "--trainer.callbacks+=tests.plugins.faults.KillRank",
            "--trainer.callbacks.step",
            "2",
            "--trainer.callbacks.marker",
            str(marker),
        ),
    )
    finish(run)
    log = run.log.read_text()
    assert (
        marker.exists()
        and "starting from the beginning" in log
        and "Restored all states from the checkpoint" in log
    )
    assert_same_run(one_node, tmp_path)


def test_dead_rank_stops_the_survivor_with_one_line(tmp_path):
    timeout_s = 20
    marker = tmp_path / "killed.marker"
    earl = Path(sys.executable).with_name("earl")
    cmd = [
        str(earl),
        "fit",
        "--config",
        str(RECIPE),
        "--config",
        str(overrides(tmp_path)),
        "--trainer.strategy.collective_timeout_s",
        str(timeout_s),
        "--trainer.callbacks+=tests.plugins.faults.KillRank",
        "--trainer.callbacks.step",
        "2",  # mid-run: steps 0 and 1 trained and saved, rank 1 dies as step 2 starts
        "--trainer.callbacks.marker",
        str(marker),
    ]
    proc = run_earl_process(
        cmd,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    ended = time.time()
    assert proc.returncode != 0 and marker.exists()
    assert ended - marker.stat().st_mtime < timeout_s + 30
    lines = [line for line in proc.stderr.splitlines() if line.startswith("earl: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "rank 0 lost a peer during stage 'rollout' of RL step 2" in lines[0]
    assert f"resume from {tmp_path / 'checkpoints' / 'last.ckpt'}" in lines[0]
    assert "Traceback" not in proc.stderr and (tmp_path / "rank0_failure.log").is_file()

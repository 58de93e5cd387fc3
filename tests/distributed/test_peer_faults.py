"""Recognizing a lost peer (earl_lightning/parallel/faults.py) on the errors gloo really raises: a
peer SIGKILLed ("died") and a peer SIGSTOPped past a 2 s process-group timeout ("silent"), each
produced here on 2 processes; errors that only look alike (an environment's "timed out" inside a
RuntimeError, NCCL's "invalid usage") stay what they are. The texts produced with torch 2.13
are in the module's comments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from earl_lightning.core.errors import RankFailure
from earl_lightning.parallel.faults import LostPeer, RunFacts, is_peer_failure, peer_failure
from earl_lightning.parallel.launch_env import free_port
from tests.distributed.launch import subprocess_env

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).parents[2]


def gloo_error(mode: str, timeout_s: float = 2.0) -> tuple[RuntimeError, float]:
    """The error rank 0's all-reduce raised when rank 1 was killed or stopped, rebuilt here (gloo
    raises plain RuntimeErrors), and how long rank 0 waited for it."""
    port = str(free_port())

    def cmd(rank):
        return [
            sys.executable,
            "-m",
            "tests.distributed.peer_child",
            mode,
            str(rank),
            port,
            str(timeout_s),
        ]

    env = subprocess_env(OMP_NUM_THREADS="1")
    peer = subprocess.Popen(
        cmd(1), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        start = time.monotonic()
        out = subprocess.run(
            cmd(0), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
        )
    finally:
        if peer.poll() is None:
            os.kill(peer.pid, signal.SIGKILL)
        peer.wait()
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["type"] == "builtins.RuntimeError", report
    return RuntimeError(report["text"]), time.monotonic() - start


def facts() -> RunFacts:
    return RunFacts(
        rank=0,
        step="RL step 3",
        last_checkpoint="/run/checkpoints/last.ckpt",
        log_dir="/nonexistent/x",
    )


def test_a_killed_peer_is_a_lost_peer_that_died():
    err, _ = gloo_error("kill")
    assert "gloo/transport" in str(err) and "by peer" in str(err)  # "Connection reset by peer" here
    assert peer_failure(err) == "died"
    line = str(LostPeer(facts).error("the env-failure check", err))
    assert line.startswith(
        "rank 0 lost a peer during the env-failure check of RL step 3: another process died "
        "(RuntimeError: ["
    )
    assert (
        "resume from /run/checkpoints/last.ckpt (`--ckpt_path last`)" in line and "\n" not in line
    )


@pytest.mark.parametrize("mode", ["stop", "stop_mesh", "stop_later"])
def test_a_stopped_peer_is_a_lost_peer_that_went_silent(mode):
    """Also over a layout mesh's group (the collective timeout is set on it too) and over a group
    made later with ``collective_timeout()`` (the dispatcher's broadcast groups)."""
    err, waited = gloo_error(mode, timeout_s=2.0)
    assert "Timed out waiting 2000ms for" in str(err) and "gloo/transport" in str(err)
    assert 1.5 < waited < 60
    assert peer_failure(err) == "silent"
    line = (
        r"^rank 0 lost a peer during the strategy's barrier of RL step 3: another process stopped answering "
        r"\(no reply within the collective timeout\)"
    )
    with pytest.raises(RankFailure, match=line), LostPeer(facts).during("the strategy's barrier"):
        raise err


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError(
            "env 'tests.plugins.faulty_envs.Hangs' (seed 3): step() raised TimeoutError('timed out after 5 s')"
        ),
        # gloo's words, not from gloo
        RuntimeError("Timed out waiting 3000ms for recv operation to complete"),
        RuntimeError("Connection reset by peer"),  # a tool's HTTP call
        TimeoutError("timed out"),
        ConnectionResetError("Connection reset by peer"),
        dist.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN)"
        ),
        ValueError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
    ],
)
def test_errors_that_only_look_alike_are_not_a_lost_peer(err):
    assert not is_peer_failure(err)
    with pytest.raises(type(err)) as raised, LostPeer(facts).during("the batch statistics"):
        raise err
    assert raised.value is err


@pytest.mark.parametrize(
    "err,kind",
    [
        # NCCL's texts (not producible on this CPU build): ncclRemoteError, and the watchdog's timeout
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a "
                "network error, NCCL version 2.21.5"
            ),
            "died",
        ),
        (
            dist.DistBackendError(
                "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                "OpType=ALLREDUCE) ran for 600081 milliseconds before timing out."
            ),
            "silent",
        ),
        (dist.DistStoreError("wait timeout after 30000ms, keys: /default_pg/0//cuda//0"), "silent"),
        (dist.DistNetworkError("Connection reset by peer"), "died"),
    ],
)
def test_nccl_and_store_errors_by_type_and_text(err, kind):
    assert peer_failure(err) == kind


def test_a_lost_peer_no_wrapper_saw_is_one_line_at_the_command(monkeypatch, capsys):
    """A lost peer raised where no LostPeer wraps the collective (Lightning's SIGTERM handler
    broadcasts while torchrun stops a failed round) still ends ``earl`` in one line, exit 1; any
    other error keeps its traceback."""
    from earl_lightning.cli import entry as cli

    err, _ = gloo_error("kill", timeout_s=2.0)

    def raises(*args, **kwargs):
        raise err

    monkeypatch.setattr(cli, "EarlCLI", raises)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit"])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "earl: error: this process lost a peer: another process died (RuntimeError: ["
    )
    assert lines[0].endswith("resume from the last checkpoint (`--ckpt_path last`)")
    monkeypatch.setattr(
        cli, "EarlCLI", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("timed out"))
    )
    with pytest.raises(RuntimeError, match="timed out"):
        cli.main(["fit"])

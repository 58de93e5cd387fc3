"""``tests/gpu/acceptance.sh --dry-run`` on CPU: the GPU acceptance script only runs in the rare
session that is lent a GPU, so its plumbing is checked here on every commit (earl-tiny, 2 steps;
the hf and vLLM fits with their memory tables and `earl plan`'s error tables, and the OOM
recovery). Its ``vs_trl`` part is ``benchmarks/vs_trl.py --quick``, smoke-run by
``tests/e2e/test_vs_trl.py``."""

from __future__ import annotations

import csv
import importlib.util
import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "acceptance.sh"


def read(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM (CPU build) not installed"
)
def test_dry_run_parts_pass_and_write_their_figures(tmp_path):
    # A caller's launcher variables must not leak into the parts: MASTER_PORT names a port that is
    # taken (as it was when an earlier test in the same pytest process held one).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {
            **os.environ,
            "PARTS": "fit_hf fit_vllm oom",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(taken.getsockname()[1]),
            "RANK": "0",
            "WORLD_SIZE": "1",
        }
        proc = subprocess.run(
            ["bash", str(SCRIPT), "--dry-run", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
            check=False,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    parts = read(tmp_path / "parts.csv")
    assert [(r["part"], r["exit_code"]) for r in parts] == [
        ("fit_hf", "0"),
        ("fit_vllm", "0"),
        ("oom", "0"),
    ]
    for backend in ("hf", "vllm"):
        steps = read(tmp_path / f"fit_{backend}.csv")
        assert len(steps) == 2
        assert all(abs(float(r["logprob/mismatch"])) < 1e-3 for r in steps), steps
        assert read(tmp_path / f"memory_{backend}.csv")
        # earl plan's time model (the CPU profile here) against every stage after the warm-up step
        plan = read(tmp_path / f"plan_errors_{backend}.csv")
        assert sorted(r["stage"] for r in plan) == ["experience", "rollout", "train"], plan
        assert all(float(r["predicted_s"]) >= 0 and float(r["measured_s"]) > 0 for r in plan)
    # the big micro-batch fails, the stage reruns under the next layout
    oom = read(tmp_path / "oom.csv")
    first_step = [r for r in oom if r["step"] == oom[0]["step"]]
    assert [r["ok"] for r in first_step][:2] == ["False", "True"], oom
    assert first_step[0]["layout"] != first_step[1]["layout"]


def test_unknown_part_is_refused(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PARTS": "fit_hf fit_tpu"},
        check=False,
    )
    assert proc.returncode == 64
    assert "unknown part 'fit_tpu' in PARTS; the parts: fit_hf fit_vllm oom vs_trl" in proc.stderr

"""Shared launcher for the vLLM scenario (tests/vllm/scenario.py) under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import subprocess_env  # noqa: F401 - re-exported for the vLLM tests

SCENARIO = Path(__file__).with_name("scenario.py")


def run_scenario(
    out_dir: Path, nproc: int = 2, device: str = "cpu", timeout: float = 540.0
) -> list[dict]:
    """Run the scenario on ``nproc`` torchrun processes; returns each rank's measurements."""
    env = subprocess_env(
        EARL_SCENARIO_OUT=str(out_dir),
        EARL_SCENARIO_DEVICE=device,
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )  # the test plugins' envs
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(SCENARIO),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vLLM scenario failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(autouse=True)
def _restore_environment():
    """``import vllm`` (done in-process by the construction-error tests) sets environment variables
    such as TORCHINDUCTOR_COMPILE_THREADS; put the environment back for the tests that follow.
    Engines are only ever built in subprocesses (the scenario and the recipe runs)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

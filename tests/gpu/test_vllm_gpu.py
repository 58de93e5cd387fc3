"""The tests/vllm scenario on CUDA with the official vLLM (skipped without 2 GPUs and vLLM).

Same checks as tests/vllm/test_vllm_backend.py: TP 1 and TP 2 engines colocated in two torchrun
processes (one GPU each), log-probs equal to the HF recompute after a weight sync, stale weights
detected, a TP switch mid-run. The training copy and the recompute stay on CPU; the engine runs
on the GPU, so the sync also covers the host-to-device path. On GPU vLLM's sleep mode is real.
Then the vLLM recipe for 2 steps on 2 GPUs through `earl fit`, like tests/vllm/test_vllm_recipe.py.
Not yet run on real GPUs (none were available while these were written); on CPU the same code
paths run in CI.
"""

from __future__ import annotations

import pytest
import torch

from earl_lightning.rollout.backends.vllm_support import vllm_available

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and vllm_available()),
    reason="needs 2 CUDA GPUs and vLLM (pip install 'earl_lightning[vllm]')",
)

TOL = 1e-3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.vllm.conftest import run_scenario

    return run_scenario(tmp_path_factory.mktemp("vllm_gpu"), nproc=2, device="cuda")


def test_gpu_generation_sync_stale_and_switch(ranks):
    r0, r1 = ranks
    for r in ranks:
        assert r["sleep_enabled"], "vLLM sleep mode should be available on CUDA"
        assert r["tp1_mismatch_initial"] < TOL and r["tp1_mismatch_turn2"] < TOL
        assert r["tp1_mismatch_after_sync"] < TOL and r["tp1_changed_by_sync"]
        assert r["tp1_mismatch_stale"] > 0.1 and r["stale_flagged"]
        assert r["tp2_mismatch"] < TOL and r["tp1_back_mismatch"] < TOL
        assert r["stop"]["finish"] == "stop"
    assert r0["tp2_tokens"] == r1["tp2_tokens"]


def test_gpu_vllm_recipe_two_steps(tmp_path):
    """recipes/connect4_grpo_vllm.yaml on 2 GPUs (NCCL, EarlStrategy), as tests/vllm runs it on CPU."""
    from tests.vllm.test_vllm_recipe import run_recipe, values

    s = run_recipe(tmp_path, "--trainer.accelerator", "gpu")
    assert [step for step, _ in s["reward/mean"]] == [0, 1]
    assert max(values(s, "logprob/mismatch")) < TOL

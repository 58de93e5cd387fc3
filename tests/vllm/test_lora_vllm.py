"""LoRA with the vLLM backend (issue 44, item 1): the engine runs the plain architecture and
receives the merged weights ``W + B @ A * scale`` after each update; step 1's rollout log-probs
agree with the trainer's adapted policy although the adapters moved the policy well past the
tolerance. One process, 2 steps. Skipped when vLLM is not importable."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from earl_lightning.models import load_model
from earl_lightning.rollout.backends.vllm_support import vllm_available
from tests.vllm.test_vllm_recipe import TOL, run_recipe, values

pytestmark = [
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed in this interpreter"),
    pytest.mark.distributed,
]


def test_vllm_engine_gets_the_merged_lora_weights(tmp_path):
    s = run_recipe(
        tmp_path,
        "--trainer.devices",
        "1",
        "--model.peft.r",
        "4",
        "--model.peft.alpha",
        "16",
        "--model.algorithm.kl.coef",
        "0.05",
        "--model.rollout.sampling.allowed_tokens",
        '["0", "1", "2", "3", "4", "5", "6"]',
        "--data.eval_episodes",
        "0",
    )
    mismatch = values(s, "logprob/mismatch")
    assert len(mismatch) == 2 and max(mismatch) < TOL, mismatch
    assert values(s, "grad_norm")[0] > 0
    merged = load_file(str(next(tmp_path.rglob("hf_model")) / "model.safetensors"))
    base = load_model("earl-tiny").eval()
    trained = load_model("earl-tiny").eval()
    trained.load_state_dict(merged, strict=False)
    ids = torch.tensor([[1, 5, 9, 14, 3, 22, 7, 11, 30, 2, 17, 19, 23, 29]])
    with torch.no_grad():
        moved = (
            (base(ids).logits.log_softmax(-1) - trained(ids).logits.log_softmax(-1))
            .abs()
            .max()
            .item()
        )
    assert moved > 10 * TOL, (
        f"the adapters moved the log-probs by {moved} only: the check would mean nothing"
    )

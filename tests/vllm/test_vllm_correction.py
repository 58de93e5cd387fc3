"""The rollout correction with a vLLM engine (recipes/connect4_grpo_vllm.yaml, 2 processes): the
weights are pi_old / pi_rollout with the engine's own sampled log-probs, so they differ from 1 by
the engine / trainer gap that ``logprob/mismatch`` reports, and within bounds that wide nothing is
masked. Skipped when vLLM is not importable."""

from __future__ import annotations

import math

from tests.vllm.test_vllm_recipe import pytestmark, run_recipe, values  # noqa: F401


def test_vllm_rollout_correction_weighs_the_engines_log_probs(tmp_path):
    s = run_recipe(
        tmp_path,
        "--model.algorithm.rollout_correction.level",
        "token",
        "--model.algorithm.rollout_correction.mode",
        "mask",
    )
    mismatch = values(s, "logprob/mismatch")
    low, high = (
        values(s, "rollout_correction/weight_min"),
        values(s, "rollout_correction/weight_max"),
    )
    assert len(mismatch) == len(low) == len(high) == 2
    for gap, lo, hi in zip(mismatch, low, high):
        # every token's |log w| is at most the largest |rollout - recomputed| log-prob
        assert math.exp(-gap) - 1e-6 <= lo <= hi <= math.exp(gap) + 1e-6, (gap, lo, hi)
    if max(mismatch) > 1e-6:  # the engine's own log-probs, not the trainer's, are the behaviour
        assert min(low) < 1.0 or max(high) > 1.0
    assert values(s, "rollout_correction/outside_share") == [0.0, 0.0]
    assert values(s, "grad_norm")[0] > 0

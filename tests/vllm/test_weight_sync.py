"""Weight streaming and the log-prob mismatch check; no vLLM needed (runs in every CI job)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from earl_lightning.rollout.weight_sync import (
    check_logprob_mismatch,
    hf_parameter_name,
    logprob_mismatch,
    stream_full_weights,
    weight_buckets,
)
from tests.distributed.launch import run_distributed


def _tiny_hf():
    from transformers import AutoModelForCausalLM

    from earl_lightning.models import make_tiny_model

    return AutoModelForCausalLM.from_pretrained(
        make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128), dtype=torch.float32
    )


def test_logprob_mismatch_is_max_abs_over_generated_tokens():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, 0.0]])
    recomputed = torch.tensor([[-1.0, -2.5, -3.0], [-0.4, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert logprob_mismatch(rollout, recomputed, mask).item() == pytest.approx(0.5)
    assert logprob_mismatch(rollout, recomputed, torch.zeros_like(mask)).item() == 0.0
    assert logprob_mismatch(torch.zeros(0), torch.zeros(0), torch.zeros(0)).item() == 0.0


def test_logprob_mismatch_shape_error():
    with pytest.raises(
        ValueError,
        match=r"`rollout_logprobs` \(2,\), `recomputed_logprobs` \(3,\) and `mask` \(2,\)",
    ):
        logprob_mismatch(torch.zeros(2), torch.zeros(3), torch.ones(2))


def test_check_warns_loudly_only_over_threshold(caplog):
    with caplog.at_level(logging.WARNING, logger="earl_lightning"):
        assert check_logprob_mismatch(1e-4, threshold=1e-2) is False
        assert caplog.records == []
        assert check_logprob_mismatch(torch.tensor(0.5), threshold=1e-2) is True
    (record,) = caplog.records
    assert record.name == "earl_lightning" and record.levelno == logging.WARNING
    assert re.search(r"!!! rollout: .* up to 0.5 .*stale", record.getMessage())


def test_hf_names_strip_wrappers():
    assert (
        hf_parameter_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_parameter_name("module.lm_head.weight") == "lm_head.weight"


def test_buckets_cover_every_parameter_once_within_budget():
    model = _tiny_hf()
    params = dict(model.named_parameters())
    budget = 40_000
    buckets = weight_buckets(model, bucket_bytes=budget)
    names = [n for b in buckets for n, _ in b]
    assert names == list(params)  # order kept, tied head listed once
    for b in buckets:
        size = sum(p.numel() * p.element_size() for _, p in b)
        assert size <= budget or len(b) == 1
    with pytest.raises(ValueError, match=r"`bucket_bytes` must be a positive integer, got 0"):
        weight_buckets(model, bucket_bytes=0)


def _stream_fsdp(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _tiny_hf()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model)
    streamed = dict(stream_full_weights(model, bucket_bytes=1 << 14, dtype=torch.float32))
    return {
        "same_names": list(streamed) == list(reference),
        "max_diff": max((streamed[n] - reference[n]).abs().max().item() for n in reference),
        "sharded": any(type(p).__name__ == "DTensor" for p in model.parameters()),
    }


@pytest.mark.distributed
def test_stream_full_weights_unshards_fsdp2_exactly():
    for r in run_distributed(_stream_fsdp, 2):
        assert r["sharded"] and r["same_names"] and r["max_diff"] == 0.0

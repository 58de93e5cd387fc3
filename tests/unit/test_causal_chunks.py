"""Causal attention in query chunks (``optim.causal_chunks``, earl_lightning/train/causal_chunks.py):
on CPU the train forward's causal attention over 384 to 767 positions runs in chunks of at least
192 queries, each over the keys it sees. Outputs and gradients must equal one causal call's to
float rounding (grouped and ungrouped heads, every length the chunks take); through a model the
log-probs, entropy and gradients must equal the forward without chunks; where the chunks do not
apply (a mask, dropout, a length outside the range, another attention implementation, turned off)
transformers' own attention runs, bit for bit; the model's attention setting is restored after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.models import make_tiny_model
from earl_lightning.modules.config import OptimConfig
from earl_lightning.train import causal_chunks as cc
from earl_lightning.train.forward import fill_logprobs, forward_micro_batch
from tests.unit.test_scored_last_layer import SMALL


def test_chunk_bounds_cover_the_range_in_chunks_of_at_least_192():
    assert cc.chunk_bounds(383) is None and cc.chunk_bounds(768) is None
    assert cc.chunk_bounds(650) == [0, 217, 433, 650]
    for length in range(384, 768):
        b = cc.chunk_bounds(length)
        assert b[0] == 0 and b[-1] == length and len(b) == length // 192 + 1
        assert min(hi - lo for lo, hi in zip(b, b[1:])) >= cc.CHUNK_MIN


@pytest.mark.parametrize("length", [384, 650, 767])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_chunks_equal_one_causal_call_forward_and_backward(length, kv_heads):
    g = torch.Generator().manual_seed(length + kv_heads)
    q, k, v = (torch.randn(2, h, length, 8, generator=g) for h in (4, kv_heads, kv_heads))
    grad = torch.randn(2, length, 4, 8, generator=g)

    def run(chunked):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if chunked:
            out = cc.chunked_causal_attention(*leaves, cc.chunk_bounds(length), scale=0.3)
        else:
            out = F.scaled_dot_product_attention(
                *leaves, is_causal=True, scale=0.3, enable_gqa=kv_heads != 4
            ).transpose(1, 2)
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, "max_position_embeddings": 1024}))


def _qwen():
    return AutoModelForCausalLM.from_pretrained(make_tiny_model("earl-tiny"))


def _batch(lengths=(650, 600, 420), vocab=100) -> ExperienceBatch:
    """Right-padded rows up to ``max(lengths)``; every fifth token an action."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    mask = [(torch.arange(n) % 5 == 4).float() for n in lengths]
    return ExperienceBatch.from_sequences(
        {"input_ids": ids, "action_mask": mask, "advantages": [torch.randn(n) for n in lengths]},
        {"rewards": torch.zeros(len(lengths)), "group_ids": torch.arange(len(lengths))},
    )


def _run(model, mb, chunked, **kw):
    model.zero_grad(set_to_none=True)
    res = forward_micro_batch(model, mb, temperature=1.0, with_entropy=True, chunked=chunked, **kw)
    m = mb.tokens["action_mask"]
    sum((v * m).sum() for v in res.values()).backward()
    return {k: v.detach() for k, v in res.items()}, [p.grad.clone() for p in model.parameters()]


def _spy(monkeypatch) -> list[list[int]]:
    """The bounds of every chunked call."""
    calls, real = [], cc.chunked_causal_attention
    monkeypatch.setattr(
        cc, "chunked_causal_attention", lambda *a, **k: calls.append(a[3]) or real(*a, **k)
    )
    return calls


@pytest.mark.parametrize("make", [_qwen, _llama], ids=["qwen2", "llama"])
@pytest.mark.parametrize("scored", [False, True], ids=["plain", "scored-last-layer"])
def test_a_model_forward_with_chunks_equals_it_without(make, scored, monkeypatch):
    model, mb = make(), _batch()
    plain = _run(model, mb, False, scored=scored)
    calls = _spy(monkeypatch)
    chunked = _run(model, mb, True, scored=scored)
    # every layer the model runs itself (the scored last layer calls the kernel on its own)
    assert calls == [cc.chunk_bounds(650)] * (1 if scored else 2)
    assert model.config._attn_implementation == "sdpa"  # restored
    (ra, ga), (rb, gb) = plain, chunked
    for k in ra:
        torch.testing.assert_close(ra[k], rb[k], atol=1e-5, rtol=1e-5, msg=k)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_the_experience_forward_takes_them_and_the_setting_turns_them_off(monkeypatch):
    model, mb = _qwen(), _batch()
    assert OptimConfig().causal_chunks
    calls = _spy(monkeypatch)
    kw = dict(name="old", temperature=1.0, micro_batch_tokens=4096)
    on = fill_logprobs(model, mb, **kw)
    assert calls
    calls.clear()
    off = fill_logprobs(model, mb, chunked=False, **kw)
    assert not calls
    torch.testing.assert_close(on.tokens["old"], off.tokens["old"], atol=1e-5, rtol=1e-5)


def test_where_they_do_not_apply_transformers_attention_runs_as_it_is(monkeypatch):
    calls = _spy(monkeypatch)
    model = _qwen()
    short = _batch((300, 200))  # under two chunks
    long = _batch((800,))  # from 768 one call is as fast
    for mb in (short, long):
        a = forward_micro_batch(model, mb, temperature=1.0, chunked=True)["logprobs"]
        b = forward_micro_batch(model, mb, temperature=1.0, chunked=False)["logprobs"]
        assert torch.equal(a, b)
    # a mask (left padding here), dropout, or more keys than queries: sdpa as it is
    ids = torch.randint(3, 100, (2, 650))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with cc.causal_chunks(model):
        with_mask = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(
        with_mask, model(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0
    )
    q = torch.randn(1, 4, 400, 8)
    kv = torch.randn(1, 2, 400, 8)
    attn = model.model.layers[0].self_attn
    for kwargs in (dict(dropout=0.1), dict(is_causal=False)):
        torch.manual_seed(0)
        got, _ = cc._attention(attn, q, kv, kv, None, **kwargs)
        torch.manual_seed(0)
        want, _ = cc.sdpa_attention_forward(attn, q, kv, kv, None, **kwargs)
        assert torch.equal(got, want)
    assert not calls
    # another implementation is left alone, and an error inside the block restores the setting
    eager = _qwen()
    eager.config._attn_implementation = "eager"
    with cc.causal_chunks(eager):
        assert eager.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="inside"):
        with cc.causal_chunks(model):
            assert model.config._attn_implementation == cc.NAME
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"


def test_not_taken_for_a_model_that_recomputes_its_layers_while_recording(monkeypatch):
    """Activation checkpointing reruns a layer in the backward, after the block, with one call:
    the chunks would have saved other tensors (torch raises on that). Without gradients nothing
    reruns, so the experience forward still takes them."""
    from earl_lightning.parallel.parallelize import apply_activation_checkpointing

    calls = _spy(monkeypatch)
    model, mb = _qwen(), _batch()
    apply_activation_checkpointing(model, enabled=True)
    res = forward_micro_batch(model, mb, temperature=1.0, chunked=True)
    (res["logprobs"] * mb.tokens["action_mask"]).sum().backward()  # no CheckpointError
    assert not calls
    fill_logprobs(model, mb, name="old", temperature=1.0, micro_batch_tokens=4096)
    assert calls

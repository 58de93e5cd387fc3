"""The prefill's last decoder layer at the last column only (``HFBackend(prefill_tail=True)``,
earl_lightning/rollout/backends/prefill_tail.py): the logits a prefill returns and the keys and
values it leaves in the cache must equal the whole layer's, for Qwen2, Llama and Qwen3 layers;
multi-turn play over ragged contexts (a reused buffer, a repacked one, a chunked prefill) must
draw the same tokens; a model it cannot run on runs the whole layer."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from earl_lightning.models import build_char_tokenizer, make_tiny_model
from earl_lightning.models.llama_layers import last_layer
from earl_lightning.rollout.backends.base import GenRequest, SamplingConfig
from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.rollout.backends.kv import attention_masks, build_cache
from earl_lightning.rollout.backends.prefill_tail import can_prefill_tail, last_column_only


def _small(tok) -> dict:
    return dict(
        vocab_size=(len(tok) + 7) // 8 * 8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


def _qwen2(tok):
    return AutoModelForCausalLM.from_pretrained(
        make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    )


def _llama(tok):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_small(tok)))


def _qwen3(tok):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**_small(tok), head_dim=16))


BUILDERS = {"qwen2": _qwen2, "llama": _llama, "qwen3": _qwen3}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request, tok):
    return BUILDERS[request.param](tok).eval()


def _play(backend: HFBackend, turns: int = 3) -> list:
    """Turns over ragged contexts; key 1 skips turn 1, so turn 2 repacks rather than reusing
    the previous buffer whole."""
    g = torch.Generator().manual_seed(7)
    ctx = {k: torch.randint(3, 60, (n,), generator=g).tolist() for k, n in enumerate([5, 17, 30])}
    sampling = SamplingConfig(max_new_tokens=5, seed=3, temperature=0.9)
    outs_all = []
    for turn in range(turns):
        reqs = [GenRequest(k, c) for k, c in ctx.items() if not (turn == 1 and k == 1)]
        outs = backend.generate(reqs, sampling)
        outs_all.append(outs)
        for r, o in zip(reqs, outs):
            ctx[r.key] = (
                r.prompt_ids + o.token_ids + torch.randint(3, 60, (9,), generator=g).tolist()
            )
    return outs_all


def test_play_draws_what_the_whole_layer_draws(model, tok):
    assert can_prefill_tail(model)
    for chunk in (1 << 24, 64):  # one prefill forward per call, and several query chunks
        a = _play(HFBackend(model, tok, prefill_chunk_elems=chunk))
        b = _play(HFBackend(model, tok, prefill_chunk_elems=chunk, prefill_tail=False))
        for outs_a, outs_b in zip(a, b):
            for x, y in zip(outs_a, outs_b):
                assert x.token_ids == y.token_ids
                assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
    assert "forward" not in vars(last_layer(model))  # the class's forward again


def test_prefill_logits_and_cache_equal_the_whole_layer(model, tok):
    """One prefill of left-padded rows: the last column's logits and every layer's keys and
    values at every real column, with and without the tail."""
    backend = HFBackend(model, tok)
    reqs = [GenRequest(k, list(range(3, 3 + n))) for k, n in enumerate([4, 11, 7])]
    entries = [None] * len(reqs)
    results, q_columns = [], []
    q_proj = last_layer(model).self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda m, args, out: q_columns.append(args[0].shape[1]))
    for tail in (True, False):
        batch = backend._layout(reqs, entries, max_new=3)
        cache = build_cache(backend.num_layers, batch.capacity, batch.prefix_cols, entries)
        cols = torch.arange(batch.suffix_ids.shape[1])
        mask = attention_masks(batch.valid[:, : cols.numel()], cols, torch.float32, backend.windows)
        with torch.inference_mode(), last_column_only(model, tail):
            logits = backend._forward(batch.suffix_ids, batch.suffix_pos, mask, cache)
        real = batch.valid[:, : cols.numel()]
        kv = [
            (layer.keys[:, :, : cols.numel()], layer.values[:, :, : cols.numel()])
            for layer in cache.layers
        ]
        results.append((logits, kv, real))
    hook.remove()
    (la, kva, real), (lb, kvb, _) = results
    assert q_columns == [1, real.shape[1]]  # the tail's queries: the last column only
    torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    for (ka, va), (kb, vb) in zip(kva, kvb):
        for row in range(len(reqs)):
            torch.testing.assert_close(
                ka[row][:, real[row]], kb[row][:, real[row]], rtol=0, atol=1e-6
            )
            torch.testing.assert_close(
                va[row][:, real[row]], vb[row][:, real[row]], rtol=0, atol=1e-6
            )


def test_a_model_it_cannot_run_on_runs_the_whole_layer(tok):
    """A sliding-window model: the tail is not taken, the layer's forward is left alone, and the
    tail's equality with the whole layer is then trivially the plain path's."""
    local = AutoModelForCausalLM.from_pretrained(
        make_tiny_model("earl-tiny-local", hidden_size=64, intermediate_size=128, sliding_window=8)
    )
    assert not can_prefill_tail(local)
    with last_column_only(local):
        assert "forward" not in vars(last_layer(local))


def test_the_layer_is_restored_when_the_forward_raises(model):
    layer = last_layer(model)
    with pytest.raises(RuntimeError, match="boom"), last_column_only(model):
        assert "forward" in vars(layer)
        raise RuntimeError("boom")
    assert "forward" not in vars(layer)

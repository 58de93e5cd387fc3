"""A decode step through the model's modules without transformers' wrapping
(``HFBackend(direct_decode=True)``, earl_lightning/rollout/backends/decode_step.py): the logits
and the cache it leaves equal the model's forward bit for bit, for Qwen2, Llama and Qwen3 layers;
play draws the same tokens with the same log-probs; a model with hooks, a sliding window or in
training keeps the model's forward. And the decode mask kept across steps equals the one
``attention_masks`` builds at every step, and the call's layout, built as whole tensors, equals the
row-by-row one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from earl_lightning.models import build_char_tokenizer, make_tiny_model
from earl_lightning.rollout.backends.base import GenRequest
from earl_lightning.rollout.backends.decode_step import (
    can_decode_direct,
    decode_logits,
    decode_parts,
    step_masks,
)
from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.rollout.backends.kv import attention_masks, build_cache, gqa_attention
from tests.unit.test_prefill_tail import BUILDERS, _play


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request, tok):
    return BUILDERS[request.param](tok).eval()


def _one_step(backend, model, direct: bool, parts: bool = False):
    """Prefill three ragged rows, then one decode step; its logits and every layer's cache.
    ``parts``: the direct step with its parts looked up beforehand, as a generation call does."""
    reqs = [GenRequest(k, list(range(3, 3 + n))) for k, n in enumerate([4, 11, 7])]
    entries = [None] * len(reqs)
    batch = backend._layout(reqs, entries, max_new=3)
    cache = build_cache(backend.num_layers, batch.capacity, batch.prefix_cols, entries)
    width = batch.suffix_ids.shape[1]
    with torch.inference_mode(), gqa_attention(model):
        cols = torch.arange(width)
        mask = attention_masks(batch.valid[:, :width], cols, torch.float32, backend.windows)
        backend._forward(batch.suffix_ids, batch.suffix_pos, mask, cache)
        batch.valid[:, width] = True
        mask = attention_masks(
            batch.valid[:, : width + 1], torch.tensor([width]), torch.float32, backend.windows
        )
        ids = torch.tensor([[5], [9], [12]])
        pos = batch.next_pos.unsqueeze(1)
        if direct:
            found = decode_parts(model) if parts else None
            logits = decode_logits(model, ids, pos, mask, cache, parts=found)
        else:
            logits = backend._forward(ids, pos, mask, cache)
    return logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_logits_and_cache_equal_the_model_forward_bit_for_bit(model, tok):
    assert can_decode_direct(model)
    backend = HFBackend(model, tok)
    (la, kva), (lb, kvb) = _one_step(backend, model, True), _one_step(backend, model, False)
    assert torch.equal(la, lb)
    for (ka, va), (kb, vb) in zip(kva, kvb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_parts_looked_up_once_give_the_same_step(model, tok):
    """A call's parts, looked up under its attention setting, give the per-step lookup's numbers;
    the attention function they hold is the one that setting configures."""
    backend = HFBackend(model, tok)
    (la, kva), (lb, kvb) = (
        _one_step(backend, model, True, parts=True),
        _one_step(backend, model, True),
    )
    assert torch.equal(la, lb)
    for (ka, va), (kb, vb) in zip(kva, kvb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    with gqa_attention(model):
        inside = decode_parts(model)
    outside = decode_parts(model)
    assert inside.body is outside.body and len(inside.layers) == model.config.num_hidden_layers
    assert all(a[2] is not b[2] for a, b in zip(inside.layers, outside.layers))


def test_play_draws_what_the_model_forward_draws(model, tok):
    direct, plain = HFBackend(model, tok), HFBackend(model, tok, direct_decode=False)
    a, b = _play(direct), _play(plain)
    assert [[o.token_ids for o in outs] for outs in a] == [
        [o.token_ids for o in outs] for outs in b
    ]
    assert [[o.logprobs for o in outs] for outs in a] == [[o.logprobs for o in outs] for outs in b]
    assert direct.stats["direct_decode_steps"] > 0 and plain.stats["direct_decode_steps"] == 0
    assert direct.stats["forwards"] == plain.stats["forwards"]


def test_hooks_a_window_training_or_flash_attention_keep_the_model_forward(model, tok):
    seen = []
    layer = model.get_decoder().layers[0]
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(1))
    try:
        assert not can_decode_direct(model)
        backend = HFBackend(model, tok)
        _play(backend, turns=1)
        assert backend.stats["direct_decode_steps"] == 0 and len(seen) == backend.stats["forwards"]
    finally:
        handle.remove()
    model.train()
    try:
        assert not can_decode_direct(model)
    finally:
        model.eval()
    plain = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"  # reads the layer's position ids
    try:
        assert not can_decode_direct(model)
    finally:
        model.config._attn_implementation = plain
    with gqa_attention(model):  # as generation routes SDPA
        assert can_decode_direct(model)
    local = AutoModelForCausalLM.from_pretrained(
        make_tiny_model("earl-tiny-local", hidden_size=64, intermediate_size=128, sliding_window=8)
    )
    assert not can_decode_direct(local.eval())


def test_the_kept_mask_equals_the_rebuilt_one(tok):
    """Rows finish at different steps; at each step the kept mask equals attention_masks'."""
    model = BUILDERS["qwen2"](tok).eval()
    backend = HFBackend(model, tok)
    reqs = [GenRequest(k, list(range(3, 3 + n))) for k, n in enumerate([4, 11, 7, 2])]
    batch = backend._layout(reqs, [None] * len(reqs), max_new=6)
    step_mask = step_masks(batch.valid, backend.windows, torch.float32)
    active = torch.ones(len(reqs), dtype=torch.bool)
    for j, finished in enumerate([[], [2], [], [0, 3], []]):
        active[finished] = False
        col = batch.decode_start + j
        batch.valid[:, col] = active
        want = attention_masks(
            batch.valid[:, : col + 1], torch.tensor([col]), torch.float32, backend.windows
        )
        assert torch.equal(step_mask(col), want)


def _reference_layout(pad_id, requests, cached, max_new):
    """The call's columns written row by row, as the backend laid them out before."""
    suffixes = [r.prompt_ids[c:] for r, c in zip(requests, cached)]
    prefix_cols, width = max(cached), max(len(s) for s in suffixes)
    decode_start = prefix_cols + width
    valid = torch.zeros(len(requests), decode_start + max_new - 1, dtype=torch.bool)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    pos = torch.zeros(len(requests), width, dtype=torch.long)
    for i, (c, s) in enumerate(zip(cached, suffixes)):
        valid[i, prefix_cols - c : prefix_cols] = True
        valid[i, decode_start - len(s) : decode_start] = True
        ids[i, width - len(s) :] = torch.tensor(s)
        pos[i, width - len(s) :] = torch.arange(c, c + len(s))
    return valid, ids, pos


def test_the_layout_right_aligns_every_row(tok):
    """Ragged prompts and cached prefixes (one row cached but for its last token, one not at all):
    the columns, ids and positions equal the row-by-row layout's."""
    from earl_lightning.rollout.backends.kv import EpisodeKV

    backend = HFBackend(BUILDERS["qwen2"](tok).eval(), tok)
    g = torch.Generator().manual_seed(1)
    lengths, cached = [9, 1, 30, 12, 5], [4, 0, 29, 0, 2]
    reqs = [
        GenRequest(k, torch.randint(3, 60, (n,), generator=g).tolist())
        for k, n in enumerate(lengths)
    ]
    entries = [EpisodeKV(r.prompt_ids[:c]) if c else None for r, c in zip(reqs, cached)]
    batch = backend._layout(reqs, entries, max_new=4)
    valid, ids, pos = _reference_layout(backend.pad_id, reqs, cached, 4)
    assert torch.equal(batch.valid, valid)
    assert torch.equal(batch.suffix_ids, ids) and torch.equal(batch.suffix_pos, pos)
    assert batch.next_pos.tolist() == lengths


def test_the_rotary_table_is_the_modules_output_at_each_position(model):
    """Rows of the table equal the rotary module's own cos and sin for ragged positions."""
    from earl_lightning.rollout.backends.decode_step import rotary_table

    like = torch.empty(0)
    cos_t, sin_t, first = rotary_table(model, 5, 40, like)
    positions = torch.tensor([[5], [17], [39], [22]])
    cos, sin = model.get_decoder().rotary_emb(like, positions)
    assert torch.equal(cos_t[positions - first], cos) and torch.equal(sin_t[positions - first], sin)


def test_a_dynamic_rotary_runs_at_every_step(tok):
    """Dynamic NTK scaling recomputes its frequencies from the positions seen: no table, and the
    direct steps still draw what the model's forward draws."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from earl_lightning.rollout.backends.decode_step import rotary_table
    from tests.unit.test_prefill_tail import _small

    torch.manual_seed(0)
    config = LlamaConfig(**_small(tok))
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = LlamaForCausalLM(config).eval()
    assert model.get_decoder().rotary_emb.rope_type == "dynamic"
    assert rotary_table(model, 0, 8, torch.empty(0)) is None
    a = _play(HFBackend(model, tok))
    b = _play(HFBackend(model, tok, direct_decode=False))
    assert [[o.token_ids for o in outs] for outs in a] == [
        [o.token_ids for o in outs] for outs in b
    ]

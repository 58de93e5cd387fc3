"""HF generation backend: KV-reuse path against the re-prefill reference, sampling, stop strings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout.backends.base import GenRequest, SamplingConfig
from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.rollout.backends.sampling import filter_logits, sample_tokens


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


def _prompts(n_tokens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=g).tolist() for n in n_tokens]


def _play(backend: HFBackend, sampling: SamplingConfig, turns: int = 4, seed: int = 0):
    """Several turns over ragged contexts; each turn appends the generated tokens and a random
    'observation'. Key 1 skips turn 2, so its cache must survive a call it is absent from."""
    g = torch.Generator().manual_seed(seed + 100)
    ctx = dict(enumerate(_prompts([5, 17, 9, 30], seed)))
    log = []
    for turn in range(turns):
        reqs = [GenRequest(k, c) for k, c in ctx.items() if not (turn == 2 and k == 1)]
        outs = backend.generate(reqs, sampling)
        log.append((reqs, outs))
        for r, o in zip(reqs, outs):
            ctx[r.key] = (
                r.prompt_ids + o.token_ids + torch.randint(3, 100, (7,), generator=g).tolist()
            )
    return log


def _full_logprobs(model, prompt: list[int], gen: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(gen)]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=6, greedy=True),
        SamplingConfig(max_new_tokens=6, seed=3, temperature=0.8, top_k=20, top_p=0.9),
    ],
    ids=["greedy", "seeded"],
)
def test_kv_reuse_equals_reprefill(lm, sampling):
    model, tok = lm
    kv_log = _play(HFBackend(model, tok, reuse_kv=True), sampling)
    ref_log = _play(HFBackend(model, tok, reuse_kv=False), sampling)
    for (reqs, a), (reqs_ref, b) in zip(kv_log, ref_log):
        assert [r.prompt_ids for r in reqs] == [r.prompt_ids for r in reqs_ref]
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.finish_reason == y.finish_reason
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kv_reuse_equals_reprefill_on_cuda(lm):
    model, tok = lm
    cuda = AutoModelForCausalLM.from_pretrained(model.name_or_path).cuda().eval()
    sampling = SamplingConfig(max_new_tokens=6, seed=3, temperature=0.8)
    kv_log = _play(HFBackend(cuda, tok), sampling)
    ref_log = _play(HFBackend(model, tok, reuse_kv=False), sampling)  # CPU reference
    for (_, a), (_, b) in zip(kv_log, ref_log):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-3


def test_turn_prefills_only_the_new_suffix(lm):
    model, tok = lm
    backend = HFBackend(model, tok)
    sampling = SamplingConfig(max_new_tokens=4, seed=0)
    prompts = _prompts([12, 20])
    outs = backend.generate([GenRequest(k, p) for k, p in enumerate(prompts)], sampling)
    assert backend.stats["prefill_tokens"] == 32 and backend.stats["reused_tokens"] == 0
    extra = [5, 6, 7]
    nxt = [p + o.token_ids + extra for p, o in zip(prompts, outs)]
    backend.generate([GenRequest(k, p) for k, p in enumerate(nxt)], sampling)
    # Cached: prompt + all generated tokens but the last; new: the last generated token + extra.
    assert backend.stats["reused_tokens"] == sum(len(p) + 4 - 1 for p in prompts)
    assert backend.stats["prefill_tokens"] == 32 + 2 * (1 + len(extra))


def test_rewritten_context_is_recomputed(lm):
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=5, greedy=True)
    kv, ref = HFBackend(model, tok), HFBackend(model, tok, reuse_kv=False)
    first = _prompts([15])[0]
    kv.generate([GenRequest(7, first)], sampling)
    other = _prompts([25], seed=9)[0]  # not an extension of what key 7 cached
    a = kv.generate([GenRequest(7, other)], sampling)[0]
    b = ref.generate([GenRequest(7, other)], sampling)[0]
    assert a.token_ids == b.token_ids
    assert kv.stats["reused_tokens"] == 0


def test_logprobs_match_full_forward(lm):
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=6, seed=5, temperature=0.7)
    reqs, outs = _play(HFBackend(model, tok), sampling)[-1]
    for r, o in zip(reqs, outs):
        ref = _full_logprobs(model, r.prompt_ids, o.token_ids, 0.7)
        assert max(abs(u - v) for u, v in zip(ref, o.logprobs)) < 1e-4


def test_greedy_matches_transformers_generate(lm):
    model, tok = lm
    prompt = _prompts([23])[0]
    ours = HFBackend(model, tok).generate(
        [GenRequest(0, prompt)], SamplingConfig(max_new_tokens=8, greedy=True)
    )[0]
    ref = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    assert ours.token_ids == ref[0, len(prompt) :].tolist()
    assert ours.logprobs == [0.0] * len(ours.token_ids)


def test_chunked_prefill_equals_single_chunk(lm):
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=5, seed=1)
    reqs = [GenRequest(k, p) for k, p in enumerate(_prompts([40, 13, 27]))]
    a = HFBackend(model, tok, prefill_chunk_elems=1).generate(reqs, sampling)
    b = HFBackend(model, tok).generate(reqs, sampling)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


def test_seeded_sampling_is_independent_of_batch_and_rank(lm):
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=8, seed=11)
    prompts = _prompts([10, 30, 18])
    batched = HFBackend(model, tok).generate(
        [GenRequest(k, p) for k, p in enumerate(prompts)], sampling
    )
    alone = HFBackend(model, tok).generate([GenRequest(1, prompts[1])], sampling)[0]
    assert alone.token_ids == batched[1].token_ids  # a second "rank" with the same seed
    other = HFBackend(model, tok).generate(
        [GenRequest(1, prompts[1])], SamplingConfig(max_new_tokens=8, seed=12)
    )[0]
    assert other.token_ids != alone.token_ids


def test_stop_strings_end_the_turn(lm):
    model, tok = lm
    free = HFBackend(model, tok).generate(
        [GenRequest(k, p) for k, p in enumerate(_prompts([8] * 6))],
        SamplingConfig(max_new_tokens=12, seed=2),
    )
    # Stop on a character the unconstrained run produced mid-turn, so some rows must stop early.
    stop = tok.decode(free[0].token_ids[3:4])
    sampling = SamplingConfig(max_new_tokens=12, seed=2, stop=[stop])
    reqs = [GenRequest(k, p) for k, p in enumerate(_prompts([8] * 6))]
    outs = HFBackend(model, tok).generate(reqs, sampling)
    ref = HFBackend(model, tok, reuse_kv=False).generate(reqs, sampling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o, f in zip(outs, free):
        text = tok.decode(o.token_ids)
        if o.finish_reason == "stop" and o.token_ids[-1] != tok.eos_token_id:
            assert text.endswith(stop) and stop not in text[: -len(stop)]
        else:
            assert stop not in text
        assert o.token_ids == f.token_ids[: len(o.token_ids)]  # same draws until the stop
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) == 4


def test_eos_stops_and_is_kept(lm):
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=48, seed=0, temperature=1.5)
    outs = HFBackend(model, tok).generate(
        [GenRequest(k, p) for k, p in enumerate(_prompts([6] * 16))], sampling
    )
    eos_ended = [o for o in outs if o.token_ids[-1] == tok.eos_token_id]
    assert eos_ended, "expected some turn to end with eos at temperature 1.5"
    for o in outs:
        assert tok.eos_token_id not in o.token_ids[:-1]
        assert o.finish_reason == ("stop" if o in eos_ended else "length")
        assert len(o.token_ids) == len(o.logprobs) and (o in eos_ended or len(o.token_ids) == 48)


def test_never_samples_undecodable_ids(lm):
    model, tok = lm
    assert model.config.vocab_size > len(tok)  # the tiny model pads its vocabulary
    outs = HFBackend(model, tok).generate(
        [GenRequest(k, p) for k, p in enumerate(_prompts([5] * 8))],
        SamplingConfig(max_new_tokens=32, seed=4, temperature=3.0),
    )
    assert max(t for o in outs for t in o.token_ids) < len(tok)


def test_model_mode_is_restored_and_cache_released(lm):
    model, tok = lm
    backend = HFBackend(model, tok)
    model.train()
    try:
        backend.generate(
            [GenRequest(3, [5, 6, 7]), GenRequest(4, [8, 9])],
            SamplingConfig(max_new_tokens=2, seed=0),
        )
        assert model.training
        # the generation-only GQA attention is undone
        assert model.config._attn_implementation == "sdpa"
    finally:
        model.eval()
    assert backend.cached_keys() == [3, 4]
    backend.release([3])
    assert backend.cached_keys() == [4]
    backend.release()
    assert backend.cached_keys() == []


def test_sampling_distribution_and_filters():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]]).repeat(40000, 1)
    u = torch.rand(40000, dtype=torch.float64)
    tokens, logp = sample_tokens(logits, u, temperature=1.3)
    probs = torch.softmax(logits[0] / 1.3, -1)
    freq = torch.bincount(tokens, minlength=6).double() / 40000
    assert torch.allclose(freq, probs.double(), atol=0.01)
    assert torch.allclose(logp, probs.log()[tokens], atol=1e-6)
    top2, _ = sample_tokens(logits, u, temperature=1.0, top_k=2)
    assert set(top2.tolist()) == {0, 5}
    nucleus, lp = sample_tokens(logits, u, temperature=1.0, top_p=0.5)
    assert set(nucleus.tolist()) == {5}  # p(5) ~ 0.59 >= 0.5 on its own
    assert torch.allclose(lp, torch.log_softmax(logits[0], -1)[5].expand(40000))  # before filtering
    limited = filter_logits(logits[:1], vocab_limit=4)
    assert torch.isinf(limited[0, 4:]).all() and torch.isfinite(limited[0, :4]).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), r"`sampling.max_new_tokens` must be a positive integer, got 0"),
        (dict(temperature=0.0), r"`sampling.temperature` must be a positive number .*got 0.0"),
        (dict(top_p=0.0), r"`sampling.top_p` must be a number in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"`sampling.top_p` must be a number in \(0, 1\], got 1.5"),
        (dict(top_k=-1), r"`sampling.top_k` must be an integer >= 0 .*got -1"),
        (dict(stop="</s>"), r"`sampling.stop` must be a list of non-empty strings, got '</s>'"),
        (dict(stop=[""]), r"`sampling.stop` must be a list of non-empty strings"),
        (dict(seed=1.5), r"`sampling.seed` must be an integer or None, got 1.5"),
    ],
)
def test_sampling_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_greedy_allows_zero_temperature():
    assert SamplingConfig(greedy=True, temperature=0.0).greedy


def test_backend_errors(lm):
    model, tok = lm
    backend = HFBackend(model, tok)
    with pytest.raises(ValueError, match=r"`requests` keys must be unique .*duplicated: \[1\]"):
        backend.generate([GenRequest(1, [5]), GenRequest(1, [6])], SamplingConfig())
    with pytest.raises(ValueError, match=r"`requests` key 2: `prompt_ids` is empty"):
        backend.generate([GenRequest(2, [])], SamplingConfig())
    with pytest.raises(
        ValueError, match=r"`prefill_chunk_elems` must be a positive integer, got 0"
    ):
        HFBackend(model, tok, prefill_chunk_elems=0)
    assert backend.generate([], SamplingConfig()) == []


@pytest.fixture(scope="module")
def local_lm():
    """A sliding-window model whose window (8) is far shorter than the test contexts."""
    path = make_tiny_model(
        "earl-tiny-local", hidden_size=64, intermediate_size=128, sliding_window=8
    )
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (
        model.config.layer_types == ["sliding_attention"] * 2 and model.config.sliding_window == 8
    )
    return model, load_tokenizer(str(path))


def test_sliding_window_kv_reuse_matches_full_forward_and_reprefill(local_lm):
    model, tok = local_lm
    sampling = SamplingConfig(max_new_tokens=6, seed=5, temperature=0.7)
    kv_log = _play(HFBackend(model, tok), sampling)
    ref_log = _play(HFBackend(model, tok, reuse_kv=False), sampling)
    for (reqs, a), (_, b) in zip(kv_log, ref_log):
        for r, x, y in zip(reqs, a, b):
            assert x.token_ids == y.token_ids
            # transformers' own sliding-window mask on the unpadded sequence is the reference
            ref = _full_logprobs(model, r.prompt_ids, x.token_ids, 0.7)
            assert max(abs(u - v) for u, v in zip(ref, x.logprobs)) < 1e-4


def test_sliding_window_changes_what_the_model_sees(local_lm):
    """The window is real: tokens further back than it do not change the next-token logits."""
    model, tok = local_lm
    a, b = _prompts([40], seed=1)[0], _prompts([40], seed=2)[0]
    tail = _prompts([20], seed=3)[0]
    backend = HFBackend(model, tok, reuse_kv=False)
    sampling = SamplingConfig(max_new_tokens=1, seed=0)
    # two layers of window 8 see at most 14 tokens back: a different far prefix changes nothing
    x = backend.generate([GenRequest(0, a + tail)], sampling)[0]
    y = backend.generate([GenRequest(0, b + tail)], sampling)[0]  # same key and length: same draw
    assert x.token_ids == y.token_ids and abs(x.logprobs[0] - y.logprobs[0]) < 1e-5
    full = HFBackend(
        AutoModelForCausalLM.from_pretrained(
            make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
        ).eval(),
        tok,
        reuse_kv=False,
    )
    u = full.generate([GenRequest(0, a + tail)], sampling)[0]
    v = full.generate([GenRequest(0, b + tail)], sampling)[0]
    assert abs(u.logprobs[0] - v.logprobs[0]) > 1e-4  # a full-attention model does see the prefix


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=6, greedy=True),
        SamplingConfig(max_new_tokens=6, seed=3, temperature=0.8, top_k=20, top_p=0.9),
    ],
    ids=["greedy", "seeded"],
)
def test_shared_prompts_encode_once_and_equal_separate_encoding(lm, sampling):
    """A GRPO-style call: two prompts, each asked 4 times, and one asked once. Each shared prompt
    is encoded once (its last token per request); the draws equal encoding every request alone,
    and the next turn continues from each request's own cache."""
    model, tok = lm
    a, b = _prompts([12, 20]), _prompts([9], seed=4)[0]
    prompts = [a[0]] * 4 + [a[1]] * 4 + [b]
    shared, alone = HFBackend(model, tok), HFBackend(model, tok, share_prompts=False)
    ref = HFBackend(model, tok, reuse_kv=False)
    outs = [
        be.generate([GenRequest(k, p) for k, p in enumerate(prompts)], sampling)
        for be in (shared, alone, ref)
    ]
    assert shared.stats["shared_prompt_tokens"] == 3 * 11 + 3 * 19
    # distinct prompts, then one token each
    assert shared.stats["prefill_tokens"] == 11 + 19 + len(prompts) + 9 - 1
    assert alone.stats["shared_prompt_tokens"] == 0 and alone.stats["prefill_tokens"] == sum(
        map(len, prompts)
    )
    for other in outs[1:]:
        for x, y in zip(outs[0], other):
            assert x.token_ids == y.token_ids
            assert max((abs(u - v) for u, v in zip(x.logprobs, y.logprobs)), default=0.0) < 1e-5
    nxt = [
        GenRequest(k, p + o.token_ids + [5, 6]) for k, (p, o) in enumerate(zip(prompts, outs[0]))
    ]
    c, d = shared.generate(nxt, sampling), ref.generate(nxt, sampling)
    # the contexts differ now: nothing more shared
    assert shared.stats["shared_prompt_tokens"] == 3 * 11 + 3 * 19
    for x, y in zip(c, d):
        assert x.token_ids == y.token_ids
        assert max((abs(u - v) for u, v in zip(x.logprobs, y.logprobs)), default=0.0) < 1e-5


def _continue(
    backend: HFBackend, ctx: dict[int, list[int]], keys: list[int], sampling: SamplingConfig, g
):
    """One call for ``keys`` (in that order); each context then grows by the reply and 7 tokens."""
    outs = backend.generate([GenRequest(k, ctx[k]) for k in keys], sampling)
    for k, o in zip(keys, outs):
        ctx[k] = ctx[k] + o.token_ids + torch.randint(3, 100, (7,), generator=g).tolist()
    return outs


def test_previous_buffer_is_reused_whole_or_repacked_by_its_holes(lm):
    """A call whose requests all continue rows of the previous call's buffer takes that buffer as
    its prefix whole (rows reordered, an ended episode dropped); one whose rows would leave the
    buffer mostly holes repacks them. Either way the draws equal re-encoding every context."""
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=6, seed=7, temperature=0.9)
    calls = [
        [0, 1, 2, 3],
        [3, 1, 0, 2],
        [2, 0, 3],
        [0, 2, 3],
        [0],
    ]  # key 1 ends; then only the shortest row
    logs, stats = [], []
    for reuse in (True, False):
        backend, g = HFBackend(model, tok, reuse_kv=reuse), torch.Generator().manual_seed(11)
        ctx = dict(enumerate(_prompts([5, 17, 9, 30])))
        log = []
        for keys in calls:
            log.append(_continue(backend, ctx, keys, sampling, g))
            stats.append(backend.stats["whole_buffer_calls"])
        logs.append(log)
    for a, b in zip(*logs):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
    # calls 2-4 reuse the buffer whole; call 5 keeps one row of 4 (its 30-token neighbour set the
    # buffer's width), so it repacks; the reference path never has a buffer to reuse
    assert stats[:5] == [0, 1, 2, 3, 3] and stats[5:] == [0] * 5


@pytest.mark.parametrize("kernel", ["matmul", "sdpa"])
def test_decode_attention_with_query_heads_as_rows_equals_grouped_sdpa(kernel):
    """A decode step's query heads that share a KV head, attended as rows of it (on CPU by two
    matrix products, or by SDPA's kernel): the same attention as SDPA's ``enable_gqa`` under a
    mask with holes; a prefill (several queries) is left to ``enable_gqa``."""
    import torch.nn.functional as F

    from earl_lightning.rollout.backends.kv import (
        _sdpa_gqa_rows_attention,
        _sdpa_gqa_rows_kernel_attention,
        additive_mask,
    )

    rows_attention = (
        _sdpa_gqa_rows_attention if kernel == "matmul" else _sdpa_gqa_rows_kernel_attention
    )
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, k, d = 5, 6, 2, 23, 8
    key, value = (
        torch.randn(b, kv_heads, k, d, generator=g),
        torch.randn(b, kv_heads, k, d, generator=g),
    )
    valid = torch.rand(b, k, generator=g) > 0.3
    for q_len in (1, 4):
        query = torch.randn(b, heads, q_len, d, generator=g)
        mask = additive_mask(valid, torch.arange(k - q_len, k), torch.float32)
        ref = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True
        )
        out, _ = rows_attention(None, query, key, value, mask, scaling=0.3)
        assert out.shape == (b, q_len, heads, d)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-6)
        # a boolean mask (True: attend) is the same attention
        out, _ = rows_attention(None, query, key, value, mask == 0, scaling=0.3)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "other", [{"gqa_decode_rows": False}, {"decode_matmul": False}], ids=["grouped", "sdpa-rows"]
)
def test_rows_decode_draws_what_grouped_decode_draws(lm, other):
    """Multi-turn play with the decode's query heads as KV-head rows (two matrix products on CPU),
    with ``enable_gqa``, and with the rows through SDPA's kernel: the same tokens, log-probs within
    float rounding (earl-tiny groups 4 query heads on 2)."""
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=6, seed=3, temperature=0.9)
    a = _play(HFBackend(model, tok), sampling)
    b = _play(HFBackend(model, tok, **other), sampling)
    for (_, outs_a), (_, outs_b) in zip(a, b):
        for x, y in zip(outs_a, outs_b):
            assert x.token_ids == y.token_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0]], ids=["every-row", "chosen-rows"])
def test_a_resident_prefix_is_copied_and_every_later_column_zeroed(rows):
    """A call that takes the previous buffer whole copies its prefix columns (gathering the rows
    it continues, or as they are when it continues all of them in order) and zeroes every column
    after them: masked attention multiplies a hole by a zero weight, and uninitialised memory
    could hold NaN."""
    from earl_lightning.rollout.backends.kv import PaddedKVLayer

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 2, 6, 4, generator=g), torch.randn(3, 2, 6, 4, generator=g)
    chosen = torch.tensor(rows)
    layer = PaddedKVLayer(9, 6, [], whole=(keys, values, chosen))
    new = torch.randn(len(rows), 2, 2, 4, generator=g)
    layer.lazy_initialization(new, new)
    assert torch.equal(layer.keys[:, :, :6], keys[chosen])
    assert torch.equal(layer.values[:, :, :6], values[chosen])
    assert not layer.keys[:, :, 6:].any() and not layer.values[:, :, 6:].any()

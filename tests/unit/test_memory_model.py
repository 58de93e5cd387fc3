"""The memory model's arithmetic: sizes from a real config, how each part scales with the layout
and the statistics, the activation coefficients against what autograd really saves, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from earl_lightning.models.tiny import PRESETS, tiny_config
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.memory import MemoryModel, check_stats
from earl_lightning.parallel.model_sizes import ModelSizes
from earl_lightning.train.scored import MAX_SCORED_SHARE

STATS = dict(num_seqs=16, context_mean=400, context_max=512, context_p95=500, gen_len=32)
QWEN_05B = ModelSizes(
    num_layers=24,
    hidden_size=896,
    intermediate_size=4864,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=151936,
)


def stats(**kw):
    return {**STATS, **kw}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_num_params_matches_the_real_model(preset):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(104, **PRESETS[preset])
    with torch.device("meta"):  # sizes only: no memory, no init time
        model = AutoModelForCausalLM.from_config(cfg)
    assert ModelSizes.from_config(cfg).num_params == sum(p.numel() for p in model.parameters())


def test_num_params_untied_llama_config():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sizes = ModelSizes.from_config(cfg)
    assert not sizes.qkv_bias and not sizes.tie_word_embeddings
    assert sizes.num_params == sum(p.numel() for p in model.parameters())


def test_saved_activation_coefficients_match_autograd():
    """What one forward really saves for backward (deduplicated storages, parameters excluded)
    equals the per-token coefficients the train estimate is built from."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(104, **{**PRESETS["earl-tiny"], "num_hidden_layers": 3})
    model = AutoModelForCausalLM.from_config(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    b, t = 4, 64
    ids = torch.randint(3, 100, (b, t))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(input_ids=ids).logits.float().log_softmax(-1)
    z = ModelSizes.from_config(cfg)
    # layers + embeddings / final norm + the log-softmax output (one vocab row per token)
    predicted = (
        b * t * (z.num_layers * z.saved_per_token(1) + 3 * z.hidden_size + 6 + z.vocab_size) * 4
    )
    assert sum(saved.values()) == pytest.approx(predicted, rel=0.03)


def test_train_sharding_and_checkpointing():
    mm = MemoryModel(QWEN_05B, "bfloat16")
    one = mm.estimate("train", Layout(dp=1, tp=1), stats())
    dp4 = mm.estimate("train", Layout(dp=4, tp=1), stats())
    tp2 = mm.estimate("train", Layout(dp=2, tp=2), stats())
    assert (
        dp4.weights == one.weights // 4
        and dp4.optimizer == 2 * dp4.weights
        and dp4.grads == dp4.weights
    )
    assert tp2.weights == one.weights // 4
    # FSDP all-gather buffers only when sharded over dp
    assert dp4.transient > 0 and one.transient == 0
    # the same micro-batch on every tp rank, but the attention / MLP internals are split
    dp2 = mm.estimate("train", Layout(dp=2, tp=1), stats())
    assert dp2.activations_no_ckpt / 2 < tp2.activations_no_ckpt < dp2.activations_no_ckpt
    ck = mm.estimate("train", Layout(activation_checkpointing=True), stats())
    assert ck.activations == ck.activations_ckpt < one.activations_no_ckpt / 4
    assert ck.total < one.total


def test_train_activations_follow_micro_batch_tokens():
    mm = MemoryModel(QWEN_05B)
    small = mm.estimate("train", Layout(micro_batch_tokens=1024), stats())
    big = mm.estimate("train", Layout(micro_batch_tokens=4096), stats())
    # padded micro-batches of the longest sequence (512): 2 vs 8 sequences
    assert big.activations == pytest.approx(4 * small.activations, rel=1e-6)
    assert big.logits == 4 * small.logits


def test_micro_batches_mirror_the_modules_batching():
    from earl_lightning.batches.experience import ExperienceBatch

    lens = [512, 300, 511, 100, 480, 512, 64, 200, 512, 128]
    batch = ExperienceBatch.from_sequences(
        {
            "input_ids": [torch.ones(n, dtype=torch.long) for n in lens],
            "action_mask": [torch.ones(n, dtype=torch.long) for n in lens],
        },
        {
            "rewards": torch.zeros(len(lens)),
            "group_ids": torch.zeros(len(lens), dtype=torch.long),
            "episode_ids": torch.arange(len(lens)),
        },
    )
    mm = MemoryModel(QWEN_05B)
    for mbt in (100, 512, 1500, 2048, 100_000):
        groups = batch.micro_batch_indices(mbt)
        largest = max(len(g) * max(lens[i] for i in g) for g in groups)
        st = dict(
            num_seqs=len(lens),
            context_mean=sum(lens) / len(lens),
            context_max=512,
            context_p95=512,
            gen_len=0,
        )
        tokens, n = mm.micro_batches(Layout(micro_batch_tokens=mbt), st)
        assert largest <= tokens <= max(largest, mbt)  # never below the real largest micro-batch
        # a bound: only "more than one" matters
        assert n >= len(groups) and (n > 1) == (len(groups) > 1)


def test_rollout_kv_cache_scales_with_sequences_context_and_layout():
    mm = MemoryModel(QWEN_05B, "bfloat16", rollout_backend="vllm")
    base = mm.estimate("rollout", Layout(dp=1, tp=1), stats())
    per_tok = QWEN_05B.num_layers * QWEN_05B.num_kv_heads * QWEN_05B.head_dim * 2 * 2
    assert base.kv_cache == 16 * (400 + 32) * per_tok  # paged: only the real tokens
    assert (
        mm.estimate("rollout", Layout(dp=1, tp=1), stats(num_seqs=32)).kv_cache == 2 * base.kv_cache
    )
    # half the seqs
    assert mm.estimate("rollout", Layout(dp=2, tp=1), stats()).kv_cache == base.kv_cache // 2
    tp2 = mm.estimate("rollout", Layout(dp=1, tp=2), stats())
    assert tp2.kv_cache == base.kv_cache // 2 and tp2.weights == base.weights // 2
    # 2 KV heads cannot split 4 ways: each rank keeps one head (replicated), like the engines do
    assert mm.estimate("rollout", Layout(dp=1, tp=4), stats()).kv_cache == tp2.kv_cache
    assert base.grads == base.optimizer == 0


def test_rollout_hf_counts_this_and_the_previous_calls_buffers():
    mm = MemoryModel(QWEN_05B, "bfloat16", rollout_backend="hf")
    est = mm.estimate("rollout", Layout(), stats())
    per_tok = QWEN_05B.num_layers * QWEN_05B.num_kv_heads * QWEN_05B.head_dim * 2 * 2
    # without the prefill stats: a call may encode its whole context while the previous call's
    # buffer (its context) is still held, besides its own (context + generation)
    assert est.kv_cache == 16 * (512 + 32) * per_tok + 16 * 512 * per_tok
    assert est.total == est.weights + est.kv_cache + est.transient + est.logits + est.overhead


def test_rollout_hf_sized_by_its_dearest_call():
    """A KV cache kept between turns: the first call encodes the prompts into an empty buffer,
    a later one only its turn's new tokens next to the previous buffer; single-turn has no later."""
    mm = MemoryModel(QWEN_05B, "bfloat16", rollout_backend="hf")
    per_tok = QWEN_05B.num_layers * QWEN_05B.num_kv_heads * QWEN_05B.head_dim * 2 * 2
    whole = mm.estimate("rollout", Layout(), stats())
    turns = mm.estimate("rollout", Layout(), stats(prompt_max=100, turn_prefill_max=64))
    # the last call's buffer holds the whole context, the one before it the context before the
    # turn's 64 new tokens and 32 generated ones
    assert turns.kv_cache == 16 * 512 * per_tok + 16 * (512 - 64 - 32) * per_tok
    assert turns.kv_cache < whole.kv_cache and turns.transient < whole.transient
    single = mm.estimate("rollout", Layout(), stats(prompt_max=480, turn_prefill_max=0))
    assert single.kv_cache == 16 * (480 + 32) * per_tok < turns.kv_cache
    # a long first prompt can be the dearest call
    first = mm.estimate(
        "rollout", Layout(), stats(context_max=600, prompt_max=600, turn_prefill_max=8)
    )
    assert first.kv_cache == 16 * (600 + 32) * per_tok
    # without the kept cache every call encodes its whole context into an empty buffer
    fresh = MemoryModel(QWEN_05B, "bfloat16", rollout_backend="hf", reuse_kv=False)
    assert (
        fresh.estimate("rollout", Layout(), stats(prompt_max=100, turn_prefill_max=64)).total
        == fresh.estimate("rollout", Layout(), stats(prompt_max=512, turn_prefill_max=0)).total
    )
    vllm = MemoryModel(QWEN_05B, "bfloat16", rollout_backend="vllm")
    assert (
        vllm.estimate("rollout", Layout(), stats(prompt_max=100, turn_prefill_max=64)).total
        == vllm.estimate("rollout", Layout(), stats()).total
    )


def test_experience_and_resident_train_state():
    mm = MemoryModel(QWEN_05B, "bfloat16")
    exp = mm.estimate("experience", Layout(), stats())
    assert exp.grads == exp.optimizer == exp.kv_cache == 0 and exp.resident == 0
    assert (
        MemoryModel(QWEN_05B, "bfloat16", reference_model=True)
        .estimate("experience", Layout(), stats())
        .weights
        == 2 * exp.weights
    )
    res = MemoryModel(QWEN_05B, "bfloat16", resident_train_state=True)
    r = res.estimate("rollout", Layout(dp=1, tp=2), stats(), train_layout=Layout(dp=2, tp=1))
    assert r.resident == QWEN_05B.num_params * 2 // 2 * 3  # sharded weights + two Adam states
    assert res.estimate("train", Layout(dp=2, tp=1), stats()).resident == 0


def test_scored_last_layer_sizes_the_logits_and_the_last_layer_by_the_scored_positions():
    """Multi-turn rows of 512 positions with 40 scored: the logits are those of 16 x 40 positions,
    the last layer's saved activations mostly too; experience keeps only the scored logits."""
    plain, scored = (
        MemoryModel(QWEN_05B, "bfloat16"),
        MemoryModel(QWEN_05B, "bfloat16", scored_share_limit=MAX_SCORED_SHARE),
    )
    s = stats(context_mean=512, scored_max=40, scored_share_max=40 / 512)
    a, b = (
        plain.estimate("train", Layout(micro_batch_tokens=16 * 512), s),
        scored.estimate("train", Layout(micro_batch_tokens=16 * 512), s),
    )
    assert (
        b.logits == 16 * 40 * QWEN_05B.vocab_size * (4 * 3 + 2) and a.logits == b.logits * 512 // 40
    )
    per_layer = QWEN_05B.saved_per_token(1) * 2 * 16 * 512
    # the last layer, less K, V, input
    assert per_layer * 0.8 < a.activations - b.activations < per_layer
    assert b.total < 0.6 * a.total  # at 152k tokens of vocabulary the logits dominate
    whole = Layout(micro_batch_tokens=16 * 512)
    ea, eb = plain.estimate("experience", whole, s), scored.estimate("experience", whole, s)
    assert eb.logits == 16 * 40 * QWEN_05B.vocab_size * (4 + 2) + 40 * QWEN_05B.vocab_size * 4
    assert ea.logits > 10 * eb.logits
    # not taken: without the stats, past half the positions, under checkpointing (wrapped layers)
    for st, layout in (
        (stats(context_mean=512), Layout()),
        (stats(scored_max=300, scored_share_max=0.6), Layout()),
        (s, Layout(activation_checkpointing=True)),
    ):
        assert (
            scored.estimate("train", layout, st).total == plain.estimate("train", layout, st).total
        )


def test_the_scored_path_is_sized_up_to_the_share_the_forward_allows():
    """The memory model follows the limit it is told (the forward's MAX_SCORED_SHARE): a step
    whose scored share is above it is sized as the plain forward, one within it as the scored."""
    s = stats(scored_max=300, scored_share_max=0.6)
    plain = MemoryModel(QWEN_05B, "bfloat16").estimate("train", Layout(), s).total
    above = MemoryModel(QWEN_05B, "bfloat16", scored_share_limit=MAX_SCORED_SHARE)
    within = MemoryModel(QWEN_05B, "bfloat16", scored_share_limit=0.7)
    assert MAX_SCORED_SHARE < 0.6 and above.estimate("train", Layout(), s).total == plain
    assert within.estimate("train", Layout(), s).total < plain
    with pytest.raises(ValueError, match=r"`scored_share_limit` must be a number in \(0, 1\]"):
        MemoryModel(QWEN_05B, scored_share_limit=0.0)


def test_estimate_as_dict_and_summary():
    est = MemoryModel(QWEN_05B).estimate("train", Layout(), stats())
    d = est.as_dict()
    assert d["total"] == est.total and d["stage"] == "train"
    assert "train/dp1xtp1" in est.summary() and "optimizer=" in est.summary()


# ---- errors ------------------------------------------------------------------------------
def test_unknown_stage():
    with pytest.raises(ValueError, match=r"unknown `stage` 'rolout'; valid stages: \['rollout'"):
        MemoryModel(QWEN_05B).estimate("rolout", Layout(), stats())


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(dtype="fp8"),
            r"`dtype` must be one of \['bfloat16', 'float16', 'float32'\], got 'fp8'",
        ),
        (
            dict(optimizer="lion"),
            r"`optimizer` must be one of \['adam', 'adamw', 'sgd'\], got 'lion'",
        ),
        (
            dict(rollout_backend="trt"),
            r"`rollout_backend` must be one of \['hf', 'vllm'\], got 'trt'",
        ),
        (dict(overhead_bytes=-1), r"`overhead_bytes` must be an integer >= 0, got -1"),
        (dict(prefill_chunk_elems=0), r"`prefill_chunk_elems` must be a positive integer, got 0"),
    ],
)
def test_constructor_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        MemoryModel(QWEN_05B, **kw)


def test_torch_dtype_accepted():
    assert MemoryModel(QWEN_05B, torch.bfloat16).dtype_bytes == 2


def test_model_config_errors():
    class NotAConfig:
        hidden_size = 8

    with pytest.raises(ValueError, match=r"`model_config` NotAConfig lacks \['num_hidden_layers'"):
        MemoryModel(NotAConfig())
    with pytest.raises(
        ValueError, match=r"`model_config.hidden_size` must be a positive integer, got 0"
    ):
        dataclasses.replace(QWEN_05B, hidden_size=0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            {k: v for k, v in STATS.items() if k != "gen_len"},
            r"`stats` lacks \['gen_len'\]; required keys",
        ),
        (stats(num_seqs=0), r"`stats\['num_seqs'\]` must be a number >= 1, got 0"),
        (
            stats(context_max=float("nan")),
            r"`stats\['context_max'\]` must be a number >= 1, got nan",
        ),
        (stats(gen_len=-1), r"`stats\['gen_len'\]` must be a number >= 0, got -1"),
        (
            stats(context_mean=600),
            r"context_mean \(600\) and context_p95 \(500\) must not exceed context_max \(512\)",
        ),
        (stats(prompt_max=0), r"`stats\['prompt_max'\]` must be a number >= 1, got 0"),
        (
            stats(turn_prefill_max=-1),
            r"`stats\['turn_prefill_max'\]` must be a number >= 0, got -1",
        ),
        (
            stats(turn_prefill_max=600),
            r"`stats\['turn_prefill_max'\]` \(600\) must not exceed context_max \(512\)",
        ),
        (stats(scored_max=-1), r"`stats\['scored_max'\]` must be a number >= 0, got -1"),
        (stats(scored_share_max=1.5), r"`stats\['scored_share_max'\]` must be a share in \[0, 1\]"),
        ([1, 2], r"`stats` must be a mapping with keys"),
    ],
)
def test_stats_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        check_stats(bad)


def test_layout_type_error():
    with pytest.raises(ValueError, match=r"`layout` must be a Layout, got str"):
        MemoryModel(QWEN_05B).estimate("train", "dp1xtp1", stats())

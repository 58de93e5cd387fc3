"""The shared-prefix forward (``optim.share_prefix``, earl_lightning/train/prefix.py): sequences that
begin with the same prompt run it once and continue from its KV cache. Per-token log-probs, entropy,
values and the gradients they give must equal the plain forward's over the whole sequences, for
Qwen2 and Llama, single- and multi-turn batches, with groups of different prompt lengths, replies of
different lengths and a sequence without a generated token; one PPO update must end at the same
parameters. Where the path cannot run (activation checkpointing, sliding windows) it is not taken."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.parallelize import (
    apply_activation_checkpointing,
    set_activation_checkpointing,
)
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.train.forward import fill_logprobs, forward_micro_batch
from earl_lightning.train.prefix import can_share_prefix, plan_shared_prefix, prefix_plan
from earl_lightning.train.update import Models, ppo_update
from tests.updates import reference_update


def _qwen():
    return AutoModelForCausalLM.from_pretrained(make_tiny_model("earl-tiny"))


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def _batch(groups=((12, 4), (20, 3), (12, 2)), vocab=100, seed=0) -> ExperienceBatch:
    """Groups of (prompt length, size): each member replies with 1..6 tokens; the last member of
    the first group generated nothing (a prompt-only row). Two groups share a prompt length but
    not the prompt; a tool-style non-generated span follows some replies."""
    g = torch.Generator().manual_seed(seed)
    ids, mask, gid = [], [], []
    for k, (p, size) in enumerate(groups):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for j in range(size):
            n = 0 if (k, j) == (0, size - 1) else 1 + (j * 5 + k) % 6
            reply = torch.randint(3, vocab, (n,), generator=g)
            extra = 2 if j % 2 and n else 0
            tail = torch.randint(3, vocab, (extra,), generator=g)  # e.g. an observation
            more = torch.randint(3, vocab, (extra,), generator=g)  # and a second reply
            ids.append(torch.cat([prompt, reply, tail, more]))
            mask.append(
                torch.cat(
                    [torch.zeros(p), torch.ones(n), torch.zeros(len(tail)), torch.ones(len(more))]
                )
            )
            gid.append(k)
    s = len(ids)
    adv = [torch.randn(len(m), generator=g) * m for m in mask]
    return ExperienceBatch.from_sequences(
        {"input_ids": ids, "action_mask": mask, "advantages": adv},
        {"rewards": torch.zeros(s), "group_ids": torch.tensor(gid), "episode_ids": torch.arange(s)},
    )


def _run(model, mb, share, value_head=None, **kw):
    model.zero_grad(set_to_none=True)
    if value_head is not None:
        value_head.zero_grad(set_to_none=True)
    res = forward_micro_batch(
        model,
        mb,
        with_entropy=True,
        value_head=value_head,
        plan=prefix_plan(model, mb, share),
        **kw,
    )
    m = mb.tokens["action_mask"]
    w = torch.linspace(0.5, 1.5, mb.num_tokens)  # every token position weighs differently
    loss = sum((v * w * m).sum() for v in res.values())
    loss.backward()
    params = list(model.parameters()) + (
        list(value_head.parameters()) if value_head is not None else []
    )
    return {k: v.detach() for k, v in res.items()}, [p.grad.clone() for p in params]


def _assert_same(a, b, tol=1e-5):
    (ra, ga), (rb, gb) = a, b
    assert ra.keys() == rb.keys()
    for k in ra:
        torch.testing.assert_close(ra[k], rb[k], atol=tol, rtol=tol, msg=k)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=tol, rtol=1e-4)


def test_plan_groups_rows_by_prompt():
    mb = _batch()
    plan = plan_shared_prefix(mb)
    assert plan is not None and plan.num_prefixes == 3
    assert plan.row_prefix.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert plan.prefix_rows.tolist() == [0, 4, 7]
    # the prompt is what precedes the first generated token; a row that generated nothing is all prompt
    assert plan.prefix_lens.tolist() == [12, 12, 12, 12, 20, 20, 20, 12, 12]


def test_plan_declines_when_sharing_does_not_pay():
    assert plan_shared_prefix(_batch(groups=((5, 1), (6, 1), (7, 1)))) is None  # no prompt shared
    prompt, reply = torch.tensor([7, 8]), torch.arange(10, 20)
    rows = ExperienceBatch.from_sequences(
        {
            "input_ids": [torch.cat([prompt, reply])] * 2,
            "action_mask": [torch.cat([torch.zeros(2), torch.ones(10)])] * 2,
        },
        {"rewards": torch.zeros(2), "group_ids": torch.zeros(2), "episode_ids": torch.arange(2)},
    )
    # 2 + 2 x 10 token-passes vs 2 x 12: saves 8%, under 25%
    assert plan_shared_prefix(rows) is None
    assert plan_shared_prefix(_batch().select([0])) is None


@pytest.mark.parametrize("make", [_qwen, _llama], ids=["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_plain_forward(make, temperature):
    model = make()
    # the value head's weights, the same whichever tests ran before in this process
    torch.manual_seed(0)
    vh = torch.nn.Linear(model.config.hidden_size, 1)
    mb = _batch()
    _assert_same(
        _run(model, mb, False, vh, temperature=temperature),
        _run(model, mb, True, vh, temperature=temperature),
    )


def test_equals_plain_forward_over_allowed_tokens():
    model = _qwen()
    mb = _batch()
    kw = dict(temperature=1.0, allowed=list(range(3, 60)))
    _assert_same(_run(model, mb, False, **kw), _run(model, mb, True, **kw))


def test_equals_plain_forward_on_a_multi_turn_rollout():
    path = make_tiny_model("earl-tiny")
    model, tok = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(str(path))
    specs = [
        EpisodeSpec(
            "recall", seed=i // 8, group_id=i // 8, episode_id=i, env_kwargs={"num_turns": 3}
        )
        for i in range(16)
    ]
    eps = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=3, seed=5),
        max_turns=3,
        max_context_tokens=512,
    )
    exp = episodes_to_experience(eps)
    assert plan_shared_prefix(exp) is not None and plan_shared_prefix(exp).num_prefixes == 2
    _assert_same(_run(model, exp, False, temperature=1.0), _run(model, exp, True, temperature=1.0))
    with torch.no_grad():
        a = fill_logprobs(model, exp, name="old", temperature=1.0, micro_batch_tokens=4096)
        b = fill_logprobs(
            model, exp, name="old", temperature=1.0, micro_batch_tokens=4096, share_prefix=True
        )
    torch.testing.assert_close(a.tokens["old"], b.tokens["old"], atol=1e-5, rtol=1e-5)


def _update(model, batch, share):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Opt:  # what ppo_update uses of Lightning's optimizer wrapper
        optimizer, param_groups = opt, opt.param_groups
        step, zero_grad = opt.step, opt.zero_grad

    cfg = reference_update(
        micro_batch_tokens=4096, max_grad_norm=0.0, on_policy=True, share_prefix=share
    )
    return ppo_update(Models(model), Opt, None, batch, cfg, Reducer(), lambda loss: loss.backward())


def test_ppo_update_ends_at_the_same_parameters():
    base = _qwen()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    mb = _batch()
    sa, sb = _update(a, mb, False), _update(b, mb, True)
    # logged: the prompt token passes saved (4 x 12 + 3 x 20 + 2 x 12 prompt tokens, each prompt once)
    assert (sa.pop("train/shared_prefix_tokens"), sb.pop("train/shared_prefix_tokens")) == (
        0.0,
        132 - 44,
    )
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)


def test_not_taken_where_the_model_cannot_continue_a_cache_with_gradients():
    model = _qwen()
    assert can_share_prefix(model)
    apply_activation_checkpointing(model, enabled=False)  # wrapped, recomputation off: still fine
    assert can_share_prefix(model)
    set_activation_checkpointing(model, True)
    assert not can_share_prefix(model)
    assert prefix_plan(model, _batch()) is None and prefix_plan(_qwen(), _batch()) is not None
    windowed = AutoModelForCausalLM.from_pretrained(make_tiny_model("earl-tiny-local"))
    assert not can_share_prefix(windowed)
    # and taken or not, the forward gives the same numbers
    mb = _batch()
    _assert_same(_run(_qwen(), mb, False, temperature=1.0), _run(model, mb, True, temperature=1.0))


def test_a_config_without_layer_types_that_names_a_window_is_windowed():
    """Mistral's config has a ``sliding_window`` and no ``layer_types``: every layer is windowed, for
    the rollout's masks and for the shared-prefix decision alike (both read ``attention_windows``)."""
    from transformers import MistralConfig, MistralForCausalLM

    from earl_lightning.rollout.backends.kv import attention_windows

    cfg = MistralConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    assert attention_windows(cfg) == {"sliding_attention": 16}
    assert not can_share_prefix(MistralForCausalLM(cfg))
    assert can_share_prefix(
        MistralForCausalLM(MistralConfig(**{**cfg.to_dict(), "sliding_window": None}))
    )

"""The scored last layer (``optim.scored_last_layer``, earl_lightning/train/scored.py): the train
forward runs its last decoder layer only at the positions whose logits score an action token.
Log-probs and entropy there, and the gradients a loss over action tokens gives, must equal the
plain forward's for Qwen2, Llama, Qwen3 and Mistral, on single- and multi-turn batches with ragged
rows and a row without a generated token; a PPO update must end at the same parameters with the
same statistics. Where the path cannot run or does not pay it is not taken, and the numbers are
the plain forward's."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules.config import OptimConfig
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.parallelize import apply_activation_checkpointing
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.train import forward as forward_mod
from earl_lightning.train.forward import forward_micro_batch
from earl_lightning.train.scored import (
    can_score_last_layer,
    last_layer,
    scored_last_layer,
    scored_positions,
)
from earl_lightning.train.update import Models, ppo_update
from tests.updates import reference_update

SMALL = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _qwen():
    return AutoModelForCausalLM.from_pretrained(make_tiny_model("earl-tiny"))


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL))


def _qwen3():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16))


def _mistral():
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None))


def _batch(rows=6, vocab=100, seed=0) -> ExperienceBatch:
    """Multi-turn rows of different lengths: a prompt, then 3 turns of (reply, observation); the
    replies are 1..4 tokens, the last row generated nothing."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for r in range(rows):
        parts, flags = [torch.randint(3, vocab, (10 + r,), generator=g)], [0.0]
        for t in range(3):
            n = 0 if r == rows - 1 else 1 + (r + t) % 4
            parts += [
                torch.randint(3, vocab, (n,), generator=g),
                torch.randint(3, vocab, (5 + t,), generator=g),
            ]
            flags += [1.0, 0.0]
        ids.append(torch.cat(parts))
        mask.append(torch.cat([torch.full((len(p),), f) for p, f in zip(parts, flags)]))
    adv = [torch.randn(len(m), generator=g) * m for m in mask]
    return ExperienceBatch.from_sequences(
        {"input_ids": ids, "action_mask": mask, "advantages": adv},
        {
            "rewards": torch.zeros(rows),
            "group_ids": torch.arange(rows),
            "episode_ids": torch.arange(rows),
        },
    )


def _run(model, mb, scored, value_head=None, **kw):
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    if value_head is not None:
        value_head.zero_grad(set_to_none=True)
        params += list(value_head.parameters())
    res = forward_micro_batch(
        model, mb, with_entropy=True, scored=scored, value_head=value_head, **kw
    )
    m = mb.tokens["action_mask"]
    w = torch.linspace(0.5, 1.5, mb.num_tokens)  # every token position weighs differently
    sum((v * w * m).sum() for v in res.values()).backward()
    return {k: v.detach() for k, v in res.items()}, [p.grad.clone() for p in params]


def _assert_same(mb, a, b, tol=1e-5):
    (ra, ga), (rb, gb) = a, b
    m = mb.tokens["action_mask"] > 0
    assert ra.keys() == rb.keys()
    for k in ra:
        torch.testing.assert_close(ra[k][m], rb[k][m], atol=tol, rtol=tol, msg=k)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=tol, rtol=1e-4)


def test_scored_positions_are_those_before_each_action_token():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    pos = scored_positions(mask)
    assert pos.index.tolist() == [[1, 2, 4], [0, 0, 0], [0, 0, 0]]
    assert pos.valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]


@pytest.mark.parametrize(
    "make", [_qwen, _llama, _qwen3, _mistral], ids=["qwen2", "llama", "qwen3", "mistral"]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_plain_forward(make, temperature, monkeypatch):
    model = make()
    assert can_score_last_layer(model)
    mb = _batch()
    plain = _run(model, mb, False, temperature=temperature)
    taken = []
    real = forward_mod.scored_last_layer
    monkeypatch.setattr(forward_mod, "scored_last_layer", lambda *a: taken.append(1) or real(*a))
    scored = _run(model, mb, True, temperature=temperature)
    assert taken == [1]
    _assert_same(mb, plain, scored)
    off = mb.tokens["action_mask"] == 0  # only the scored tokens carry numbers
    assert not scored[0]["logprobs"][off].any() and not scored[0]["entropy"][off].any()


def test_equals_plain_forward_with_a_value_head():
    """PPO's critic reads the last hidden state where the logits are read: the value before token t."""
    model, mb = _qwen(), _batch()
    torch.manual_seed(0)
    vh = torch.nn.Linear(model.config.hidden_size, 1)
    plain, scored = (
        _run(model, mb, False, vh, temperature=1.0),
        _run(model, mb, True, vh, temperature=1.0),
    )
    assert set(plain[0]) == {"logprobs", "entropy", "values"}
    _assert_same(mb, plain, scored)


def test_equals_plain_forward_over_allowed_tokens():
    model, mb = _qwen(), _batch()
    kw = dict(temperature=1.0, allowed=list(range(3, 60)))
    _assert_same(mb, _run(model, mb, False, **kw), _run(model, mb, True, **kw))


def test_equals_plain_forward_on_a_multi_turn_rollout():
    path = make_tiny_model("earl-tiny")
    model, tok = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(str(path))
    specs = [
        EpisodeSpec("recall", seed=i, group_id=i, episode_id=i, env_kwargs={"num_turns": 3})
        for i in range(6)
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
    assert scored_positions(exp.padded("action_mask")).width <= 9  # 3 turns of up to 3 tokens
    _assert_same(
        exp, _run(model, exp, False, temperature=1.0), _run(model, exp, True, temperature=1.0)
    )


def test_fill_logprobs_equals_plain_on_the_actions():
    from earl_lightning.train.forward import fill_logprobs

    model, mb = _qwen(), _batch()
    # one micro-batch: the scored path
    kw = dict(name="old", temperature=1.0, micro_batch_tokens=4096)
    a, b = fill_logprobs(model, mb, **kw), fill_logprobs(model, mb, scored=True, **kw)
    on = mb.tokens["action_mask"] > 0
    torch.testing.assert_close(a.tokens["old"][on], b.tokens["old"][on], atol=1e-5, rtol=1e-5)
    assert not b.tokens["old"][~on].any()


def _update(model, batch, scored, value_head=None, **kw):
    models = Models(model, value_head)
    opt = torch.optim.SGD(models.parameters(), lr=0.1)

    class Opt:  # what ppo_update uses of Lightning's optimizer wrapper
        optimizer, param_groups = opt, opt.param_groups
        step, zero_grad = opt.step, opt.zero_grad

    cfg = reference_update(
        micro_batch_tokens=64, max_grad_norm=0.0, scored_last_layer=scored, entropy_coef=0.01, **kw
    )
    return ppo_update(models, Opt, None, batch, cfg, Reducer(), lambda loss: loss.backward())


@pytest.mark.parametrize(
    "kw",
    [dict(on_policy=True), dict(ppo_epochs=2, mini_batches=2)],
    ids=["on-policy", "two-epochs-two-mini-batches"],
)
def test_ppo_update_ends_at_the_same_parameters(kw):
    base, mb = _qwen(), _batch()
    if not kw.get("on_policy"):
        with torch.no_grad():  # stale old log-probs, so the ratios are not 1 and clipping acts
            mb.tokens["old_logprobs"] = (
                forward_micro_batch(base, mb, temperature=1.0)["logprobs"] + 0.3
            )
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    sa, sb = (
        _update(a, mb, False, **kw),
        _update(b, mb, True, **kw),
    )  # 64-token micro-batches: several each
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)


def test_ppo_update_with_a_value_head_ends_at_the_same_parameters():
    base, mb = _qwen(), _batch()
    torch.manual_seed(0)
    vh = torch.nn.Linear(base.config.hidden_size, 1)
    with torch.no_grad():
        mb.tokens["old_logprobs"] = forward_micro_batch(base, mb, temperature=1.0)["logprobs"]
        mb.tokens["values"] = torch.randn(mb.num_tokens) * mb.tokens["action_mask"]
        mb.tokens["returns"] = torch.randn(mb.num_tokens) * mb.tokens["action_mask"]
    (a, va), (b, vb) = copy.deepcopy((base, vh)), copy.deepcopy((base, vh))
    sa, sb = _update(a, mb, False, va), _update(b, mb, True, vb)
    assert "loss/value" in sa and sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    for x, y in zip([*a.parameters(), *va.parameters()], [*b.parameters(), *vb.parameters()]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shortcut", [True, False], ids=["on-policy", "old-log-probs-recomputed"])
def test_a_fit_takes_it_by_default_and_ends_where_the_plain_fit_does(
    tmp_path, monkeypatch, shortcut
):
    """Through the module: ``optim.scored_last_layer`` reaches the train (and experience) forwards,
    and two steps of a multi-turn fit end at the plain fit's parameters (AdamW: to float rounding)."""
    from tests.unit.test_adaptive import datamodule, module, trainer

    assert OptimConfig().scored_last_layer
    taken = []
    real = forward_mod.scored_last_layer
    monkeypatch.setattr(forward_mod, "scored_last_layer", lambda *a: taken.append(1) or real(*a))
    params = {}
    for scored in (False, True):
        taken.clear()
        optim = dict(micro_batch_tokens=1024, on_policy_shortcut=shortcut, scored_last_layer=scored)
        mod = module(
            optim=optim,
            rollout=dict(max_turns=3, max_context_tokens=512, sampling=dict(max_new_tokens=2)),
        )
        trainer(tmp_path / str(scored), [], steps=2).fit(mod, datamodule())
        params[scored] = {k: v.detach().clone() for k, v in mod.policy.state_dict().items()}
        assert bool(taken) == scored
        assert mod.workload.scored_last_layer == scored  # what the memory model is told
    for k in params[False]:
        torch.testing.assert_close(params[True][k], params[False][k], atol=1e-4, rtol=1e-3, msg=k)


def test_not_taken_where_it_cannot_run_or_does_not_pay():
    model = _qwen()
    # recomputation would rerun the replaced layer
    apply_activation_checkpointing(model, enabled=True)
    assert not can_score_last_layer(model)
    plain = _qwen()
    plain.gradient_checkpointing_enable()
    assert not can_score_last_layer(plain)
    assert not can_score_last_layer(
        AutoModelForCausalLM.from_pretrained(make_tiny_model("earl-tiny-local"))
    )
    assert not can_score_last_layer(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16)))
    assert not can_score_last_layer(
        GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=1, n_head=2))
    )
    kw = dict(temperature=1.0, with_entropy=True, allowed=None)
    assert forward_mod._scored_forward(model, _batch(), **kw) is None
    dense = _batch().select([0])  # mostly actions: over half the positions are scored
    dense.tokens["action_mask"] = torch.ones_like(dense.tokens["action_mask"])
    assert forward_mod._scored_forward(_qwen(), dense, **kw) is None
    silent = _batch().select([5])  # no action token at all
    assert forward_mod._scored_forward(_qwen(), silent, **kw) is None


def test_taken_inside_a_switchable_checkpoint_wrapper_while_it_does_not_recompute():
    from earl_lightning.parallel.parallelize import set_activation_checkpointing

    plain, wrapped, mb = _qwen(), _qwen(), _batch()
    apply_activation_checkpointing(wrapped, enabled=False)
    assert can_score_last_layer(wrapped)
    _assert_same(
        mb, _run(plain, mb, False, temperature=1.0), _run(wrapped, mb, True, temperature=1.0)
    )
    set_activation_checkpointing(wrapped, True)
    assert not can_score_last_layer(wrapped)
    assert can_score_last_layer(wrapped, now=False)  # once a step turns recomputation off again
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    fixed = _qwen()
    # torch's own: always recomputes
    fixed.model.layers[-1] = checkpoint_wrapper(fixed.model.layers[-1])
    assert not can_score_last_layer(fixed) and not can_score_last_layer(fixed, now=False)
    _assert_same(
        mb, _run(plain, mb, False, temperature=1.0), _run(wrapped, mb, True, temperature=1.0)
    )


def test_the_layer_is_restored_and_its_hooks_still_run():
    model, mb = _qwen(), _batch()
    layer = last_layer(model)
    calls = []
    layer.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.shape)))
    pos = scored_positions(mb.padded("action_mask"))
    ids = mb.padded("input_ids")
    with scored_last_layer(model, pos):
        logits = model(input_ids=ids).logits
    assert logits.shape[:2] == pos.index.shape and calls == [
        (*pos.index.shape, model.config.hidden_size)
    ]
    assert "forward" not in vars(layer)
    with pytest.raises(RuntimeError, match="boom"), scored_last_layer(model, pos):
        raise RuntimeError("boom")
    assert "forward" not in vars(layer)
    assert model(input_ids=ids).logits.shape[:2] == ids.shape


@pytest.mark.parametrize("scored", [True, False])
def test_the_profiler_times_the_forwards_the_trainer_runs(monkeypatch, scored):
    """``earl profile`` and AdaptiveParallelism's fit-start profile run the experience and train
    forwards as the trainer does: through the scored last layer unless the option is off (and never
    for a checkpointed layout, whose wrapped layers take the plain forward)."""
    from earl_lightning.parallel.layout import Layout
    from earl_lightning.profiling.profiler import ProfileGrid, profile_stages

    taken = []
    real = forward_mod.scored_last_layer
    monkeypatch.setattr(forward_mod, "scored_last_layer", lambda *a: taken.append(1) or real(*a))
    path = make_tiny_model("earl-tiny")
    grid = ProfileGrid(
        contexts=[64], num_seqs=[2], gen_len=1, repeats=1, stages=("experience", "train")
    )
    run = profile_stages(
        lambda: AutoModelForCausalLM.from_pretrained(path),
        load_tokenizer(str(path)),
        layouts=[Layout()],
        grid=grid,
        scored_last_layer=scored,
    )
    assert run.measured == 2
    assert len(taken) == (4 if scored else 0)  # a warm-up and a measured call per stage

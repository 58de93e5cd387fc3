"""The on-policy shortcut (``optim.on_policy_shortcut``): when one optimizer step consumes the whole
batch, the old log-probs are the training forward's own, detached, and the experience stage skips
its policy forward. It must give the same loss, statistics and gradients as the full path, and
must not be taken where the ratio is not exactly 1 or something else needs that forward."""

from __future__ import annotations

import copy

import pytest
import torch

from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules.config import AlgorithmConfig, OptimConfig, RolloutConfig
from earl_lightning.modules.views import exactly_on_policy
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.train.forward import fill_logprobs
from earl_lightning.train.update import Models, ppo_update
from tests.updates import reference_update


def test_taken_only_when_exactly_on_policy(monkeypatch):
    import earl_lightning.rollout.backends.vllm_support as vs

    monkeypatch.setattr(vs, "vllm_available", lambda: True)  # the decision only, no engine
    r, a, o = RolloutConfig(), AlgorithmConfig(), OptimConfig()
    assert exactly_on_policy(r, a, o)
    assert not exactly_on_policy(r, a, OptimConfig(ppo_epochs=2))
    assert not exactly_on_policy(r, a, OptimConfig(mini_batches=2))
    assert not exactly_on_policy(RolloutConfig(backend="vllm"), a, o)  # the engine's log-probs
    # values come from that forward
    assert not exactly_on_policy(r, AlgorithmConfig(advantage={"name": "gae"}), o)
    assert not exactly_on_policy(r, AlgorithmConfig(kl={"coef": 0.1, "in_reward": True}), o)
    # KL in the loss needs only the reference
    assert exactly_on_policy(r, AlgorithmConfig(kl={"coef": 0.1}), o)
    assert not exactly_on_policy(r, a, OptimConfig(on_policy_shortcut=False))


def _batch(model, tok):
    specs = [
        EpisodeSpec(
            "recall", seed=i // 2, group_id=i // 2, episode_id=i, env_kwargs={"num_turns": 2}
        )
        for i in range(6)
    ]
    eps = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=3, seed=5),
        max_turns=2,
        max_context_tokens=512,
    )
    exp = episodes_to_experience(eps)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(exp.num_tokens, generator=g) * exp.tokens["action_mask"]
    return type(exp)(exp.cu_seqlens, {**exp.tokens, "advantages": adv}, exp.seqs)


def _update(model, batch, on_policy: bool, aggregation: str):
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)

    class Opt:  # what ppo_update uses of Lightning's optimizer wrapper
        optimizer, param_groups = opt, opt.param_groups
        step, zero_grad = opt.step, opt.zero_grad

    cfg = reference_update(
        micro_batch_tokens=64,
        loss_params={"clip_low": 0.2, "clip_high": 0.28},
        max_grad_norm=0.0,
        on_policy=on_policy,
        aggregation=aggregation,
    )
    return ppo_update(Models(model), Opt, None, batch, cfg, Reducer(), lambda loss: loss.backward())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_shortcut_equals_the_full_path(aggregation):
    path = make_tiny_model("earl-tiny")
    from transformers import AutoModelForCausalLM

    model, tok = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(str(path))
    batch = _batch(model, tok)
    full_model, short_model = copy.deepcopy(model), copy.deepcopy(model)
    full_batch = fill_logprobs(
        full_model, batch, name="old_logprobs", temperature=1.0, micro_batch_tokens=64
    )
    full = _update(full_model, full_batch, on_policy=False, aggregation=aggregation)
    # no old_logprobs in the batch
    short = _update(short_model, batch, on_policy=True, aggregation=aggregation)
    for key in (
        "loss/policy",
        "policy/entropy",
        "policy/clip_frac",
        "policy/approx_kl",
        "policy/ratio_mean",
    ):
        assert short[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    assert short["policy/ratio_mean"] == pytest.approx(1.0) and short["policy/clip_frac"] == 0.0
    for (name, a), b in zip(full_model.named_parameters(), short_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)  # SGD: equal gradients
    assert (
        sum((a - b).abs().sum() for a, b in zip(model.parameters(), short_model.parameters())) > 0
    )
    # the free weight-sync check still runs: the rollout's log-probs against the training forward's
    expected = (
        (full_batch.tokens["rollout_logprobs"] - full_batch.tokens["old_logprobs"]).abs()
        * full_batch.tokens["action_mask"]
    ).max()
    assert (
        short["logprob/mismatch"] == pytest.approx(float(expected), abs=1e-5)
        and short["logprob/mismatch"] < 1e-4
    )

"""A policy restricted to a set of tokens (``--model.rollout.sampling.allowed_tokens``): the sampler masks every other
token, and the trainer's log-probs, entropy and KL are over the same set, so the rollout's sampled
log-probs still equal the trainer's recompute."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from earl_lightning.algorithms import (
    entropy,
    logprobs_from_logits,
    shifted_entropy,
    shifted_logprobs,
)
from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules import AgenticRLModule
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.rollout.backends.sampling import sample_tokens
from earl_lightning.train.forward import fill_logprobs, forward_micro_batch

DIGITS = [str(d) for d in range(7)]


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


def test_logprobs_and_entropy_are_over_the_allowed_tokens_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    allowed = torch.tensor([7, 2, 9])
    labels = torch.tensor([[7, 2, 9, 2, 7], [9, 9, 2, 7, 2]])
    t = 0.7
    sub = logits[..., [7, 2, 9]] / t
    expected = torch.log_softmax(sub, -1).gather(
        -1, torch.tensor([[0, 1, 2, 1, 0], [2, 2, 1, 0, 1]])[..., None]
    )
    got = logprobs_from_logits(logits, labels, t, allowed)
    torch.testing.assert_close(got, expected.squeeze(-1))
    p = torch.softmax(sub, -1)
    torch.testing.assert_close(entropy(logits, t, allowed), -(p * p.log()).sum(-1))
    got.sum().backward()  # gradient reaches exactly the allowed logits
    assert logits.grad[..., [0, 1, 3, 4, 5, 6, 8, 10]].abs().max() == 0
    assert logits.grad[..., [2, 7, 9]].abs().max() > 0


def test_shifted_helpers_with_allowed_tokens_are_finite_at_prompt_positions():
    torch.manual_seed(1)
    logits = torch.randn(1, 6, 11)
    ids = torch.tensor([[0, 4, 7, 5, 2, 10]])  # 4, 5 and 10 are prompt tokens outside the set
    allowed = torch.tensor([2, 7])
    lp = shifted_logprobs(logits, ids, allowed=allowed)
    ent = shifted_entropy(logits, allowed=allowed)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert lp[0, 0] == 0 and ent[0, 0] == 0
    for t, tok in ((2, 7), (4, 2)):
        torch.testing.assert_close(
            lp[0, t], torch.log_softmax(logits[0, t - 1, [2, 7]], -1)[[2, 7].index(tok)]
        )
    assert float(ent.max()) <= float(torch.log(torch.tensor(2.0))) + 1e-6


def test_bad_allowed_ids_are_named():
    with pytest.raises(
        ValueError, match=r"`allowed` token ids must lie in \[0, 11\).*got \[3, 11\]"
    ):
        logprobs_from_logits(
            torch.zeros(1, 2, 11),
            torch.zeros(1, 2, dtype=torch.long),
            allowed=torch.tensor([3, 11]),
        )
    with pytest.raises(ValueError, match=r"`allowed` must be a non-empty 1-D tensor"):
        entropy(torch.zeros(2, 11), allowed=torch.tensor([], dtype=torch.long))


def test_sampler_draws_only_allowed_tokens_with_renormalized_logprobs():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]]).repeat(40000, 1)
    u = torch.rand(40000, dtype=torch.float64)
    tokens, logp = sample_tokens(logits, u, temperature=1.3, allowed=[1, 3, 4])
    probs = torch.softmax(logits[0, [1, 3, 4]] / 1.3, -1)
    freq = torch.bincount(tokens, minlength=6).double() / 40000
    assert set(tokens.tolist()) == {1, 3, 4}
    assert torch.allclose(freq[[1, 3, 4]], probs.double(), atol=0.01)
    where = {1: 0, 3: 1, 4: 2}
    assert torch.allclose(logp, probs.log()[[where[t] for t in tokens.tolist()]], atol=1e-6)
    greedy, _ = sample_tokens(logits[:3], u[:3], temperature=1.0, greedy=True, allowed=[2, 4])
    assert greedy.tolist() == [2, 2, 2]  # the argmax among the allowed, not token 5


@pytest.mark.parametrize(
    "ids, shown",
    [([], r"\[\]"), ([3, 3], r"\[3, 3\]"), ([-1], r"\[-1\]"), ("12", "'12'"), ([1.0], r"\[1.0\]")],
)
def test_sampling_config_rejects_bad_allowed_token_ids(ids, shown):
    with pytest.raises(
        ValueError,
        match=r"`sampling.allowed_token_ids` must be None or a non-empty list of "
        r"distinct token ids \(integers >= 0\), got " + shown,
    ):
        SamplingConfig(allowed_token_ids=ids)


def _episodes(lm, allowed_ids, *, temperature=0.9, seed=3):
    model, tok = lm
    specs = [
        EpisodeSpec(
            "connect_four",
            seed=200 + i,
            group_id=i,
            episode_id=i,
            env_kwargs={"opponent": "random", "seat": "alternate"},
        )
        for i in range(6)
    ]
    sampling = SamplingConfig(
        max_new_tokens=1, temperature=temperature, seed=seed, allowed_token_ids=allowed_ids
    )
    return rollout(
        specs, HFBackend(model, tok), tok, sampling, max_turns=21, max_context_tokens=4096
    )


def test_rollout_samples_only_allowed_tokens_and_logprobs_equal_the_trainer_recompute(lm):
    model, tok = lm
    allowed = [tok.convert_tokens_to_ids(d) for d in DIGITS]
    episodes = _episodes(lm, allowed)
    generated = [t for ep in episodes for t, m in zip(ep.token_ids, ep.action_mask) if m]
    assert len(generated) > 20 and set(generated) <= set(allowed)
    assert not any(ep.error for ep in episodes)
    exp = episodes_to_experience(episodes)
    exp = fill_logprobs(
        model, exp, name="old_logprobs", temperature=0.9, micro_batch_tokens=4096, allowed=allowed
    )
    mask = exp.tokens["action_mask"].bool()
    worst = (exp.tokens["old_logprobs"] - exp.tokens["rollout_logprobs"])[mask].abs().max()
    assert float(worst) < 1e-4
    # Without the restriction the recompute would be the unrestricted policy: a different number.
    plain = fill_logprobs(model, exp, name="old_logprobs", temperature=0.9, micro_batch_tokens=4096)
    assert (
        float((plain.tokens["old_logprobs"] - exp.tokens["rollout_logprobs"])[mask].abs().max())
        > 1e-2
    )
    with torch.no_grad():
        ent = forward_micro_batch(
            model,
            exp.select(list(range(exp.num_seqs))),
            temperature=0.9,
            with_entropy=True,
            allowed=allowed,
        )["entropy"]
    assert float(ent[mask].max()) <= float(torch.log(torch.tensor(7.0))) + 1e-5


def test_module_resolves_allowed_tokens_and_rejects_bad_ones():
    from earl_lightning.parallel.collectives import Reducer
    from earl_lightning.parallel.layout import Layout
    from earl_lightning.stages import StageContext

    module = AgenticRLModule(rollout={"sampling": {"allowed_tokens": DIGITS}})
    tok = module.tokenizer
    assert module.allowed_token_ids == [tok.convert_tokens_to_ids(d) for d in DIGITS]
    assert module.sampling.allowed_token_ids == module.allowed_token_ids
    ctx = StageContext("train", Layout(), Reducer(), None, lambda attr: getattr(module, attr))
    assert module._update_config(ctx).allowed_token_ids == module.allowed_token_ids
    assert AgenticRLModule().allowed_token_ids is None


@pytest.mark.parametrize(
    "value, match",
    [
        (
            ["1", "12"],
            r"`--model.rollout.sampling.allowed_tokens` entry '12' is 2 tokens \[\d+, \d+\] for this "
            r"tokenizer; each entry must be exactly one token",
        ),
        (
            [],
            r"`--model.rollout.sampling.allowed_tokens` must be a non-empty list of non-empty strings such as "
            r"\['0', '1', '2'\], got \[\]",
        ),
        (
            "0123",
            r"`--model.rollout.sampling.allowed_tokens` must be a non-empty list of non-empty strings .*got '0123'",
        ),
        (
            ["0", ""],
            r"`--model.rollout.sampling.allowed_tokens` must be a non-empty list of non-empty strings "
            r".*got \['0', ''\]",
        ),
        (
            ["3", "3"],
            r"`--model.rollout.sampling.allowed_tokens` entries \['3'\] map to the same token; list each "
            r"token once",
        ),
    ],
)
def test_bad_allowed_tokens_are_rejected_at_configuration(value, match):
    with pytest.raises(ValueError, match=match):
        AgenticRLModule(rollout={"sampling": {"allowed_tokens": value}})

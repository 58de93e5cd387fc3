"""KL estimators, KL reward shaping, log-probs / entropy through TRL's kernels and a real model."""

import math

import pytest
import torch

from earl_lightning.algorithms import (
    KL_ESTIMATORS,
    entropy,
    entropy_bonus,
    get_kl_estimator,
    kl_divergence,
    kl_k3,
    kl_penalized_rewards,
    logprobs_from_logits,
    shifted_entropy,
    shifted_logprobs,
)


def test_kl_estimators_by_hand():
    lp = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]])
    ref = torch.tensor([[math.log(0.25), math.log(0.4), 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    # d = ref - lp = [ln 0.5, ln 2]
    torch.testing.assert_close(
        kl_divergence(lp, ref, mask, "k1"), torch.tensor([[math.log(2), -math.log(2), 0.0]])
    )
    l2 = math.log(2) ** 2 / 2
    torch.testing.assert_close(kl_divergence(lp, ref, mask, "k2"), torch.tensor([[l2, l2, 0.0]]))
    # k3 = e^d - d - 1: d = ln 0.5 -> 0.5 + ln 2 - 1; d = ln 2 -> 2 - ln 2 - 1
    expected = torch.tensor([[math.log(2) - 0.5, 1 - math.log(2), 0.0]])
    torch.testing.assert_close(kl_divergence(lp, ref, mask, "k3"), expected)


def test_k3_is_unbiased_and_k1_too():
    # Sampling from p, the means of k1 and k3 both estimate KL(p || q); k3 with far less variance.
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, lq = p.log()[x], q.log()[x]
    k1, k3 = get_kl_estimator("k1")(lp, lq), get_kl_estimator("k3")(lp, lq)
    assert float(k1.mean()) == pytest.approx(true_kl, abs=5e-3)
    assert float(k3.mean()) == pytest.approx(true_kl, abs=5e-3)
    assert bool((k3 >= 0).all()) and float(k3.var()) < float(k1.var())


def test_k3_clamped():
    out = kl_k3(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]))
    assert torch.isfinite(out).all() and out.max().item() == 10.0


def test_kl_penalized_rewards():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    lp = torch.tensor([[0.0, -1.0, -2.0, -9.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.5, -1.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    got = kl_penalized_rewards(rewards, lp, ref, mask, coef=0.1, estimator="k1")
    # k1 on tokens 1, 2: 0.5 and -1.0
    torch.testing.assert_close(got, torch.tensor([[0.0, -0.05, 1.1, 0.0]]))
    assert not got.requires_grad  # a reward is not a gradient path


def test_kl_loss_term_has_gradient():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    kl = kl_divergence(lp, torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2), "k3")
    kl.sum().backward()
    # d/dlp (e^(ref - lp) - (ref - lp) - 1) = 1 - e^(ref - lp)
    torch.testing.assert_close(lp.grad, torch.tensor([[1 - math.exp(-0.5), 0.0]]))


def test_logprobs_and_entropy_match_naive_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    for temperature in (1.0, 0.7):
        naive = torch.log_softmax(logits / temperature, -1)
        expected = naive.gather(-1, labels[..., None]).squeeze(-1)
        torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature), expected)
        torch.testing.assert_close(entropy(logits, temperature), -(naive.exp() * naive).sum(-1))
    logprobs_from_logits(logits, labels).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_shifted_logprobs_match_hf_causal_lm_loss():
    from earl_lightning.models import load_model, make_tiny_model

    model = load_model(str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)))
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    lp = shifted_logprobs(out.logits, ids)
    assert lp.shape == (2, 7) and bool((lp[:, 0] == 0).all())
    # HF shifts labels inside the model: its loss is the mean NLL of tokens 1..L-1 given their prefix.
    torch.testing.assert_close(-lp[:, 1:].mean(), out.loss, rtol=1e-5, atol=1e-6)
    # Entry t is predicted by the logits at t - 1.
    step = torch.log_softmax(out.logits[0, 2], -1)[ids[0, 3]]
    torch.testing.assert_close(lp[0, 3], step)
    ent = shifted_entropy(out.logits, temperature=0.5)
    assert ent[:, 0].eq(0).all()
    torch.testing.assert_close(ent[:, 1:], entropy(out.logits[:, :-1], 0.5))


def test_entropy_bonus_sign_and_aggregation():
    ent = torch.tensor([[1.0, 3.0], [2.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert entropy_bonus(ent, mask, coef=0.01).item() == pytest.approx(-0.01 * 2.0)
    assert entropy_bonus(ent, mask, coef=0.01, mode="seq_mean_token_mean").item() == pytest.approx(
        -0.01 * 2.0
    )
    assert entropy_bonus(ent, mask, coef=0.01, num_tokens=6).item() == pytest.approx(-0.01 * 1.0)


def test_registry_and_errors():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    with pytest.raises(
        ValueError,
        match=r"unknown `kl_estimator` 'low_var_kl'; valid KL estimators: \['k1', 'k2', 'k3'\]",
    ):
        get_kl_estimator("low_var_kl")
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError, match=r"unknown `estimator` 'kl'"):
        kl_divergence(z, z, z, "kl")
    with pytest.raises(ValueError, match=r"`coef` must be a number >= 0, got -0.1"):
        kl_penalized_rewards(z, z, z, z, coef=-0.1)
    with pytest.raises(
        ValueError, match=r"`ref_logprobs` has shape \(1, 2\), expected \(1, 3\) like `logprobs`"
    ):
        kl_divergence(z, torch.zeros(1, 2), z)
    with pytest.raises(ValueError, match=r"`temperature` must be a positive number, got 0"):
        logprobs_from_logits(
            torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), temperature=0
        )
    with pytest.raises(ValueError, match=r"`labels` has shape \(1, 3\), expected \(1, 2\)"):
        logprobs_from_logits(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"`input_ids` has shape \(1, 3\), expected \(1, 2\) to match `logits`"
    ):
        shifted_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`logits` must be \[B, L, V\], got shape \(2, 4\)"):
        shifted_entropy(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"`temperature` must be a positive number, got -1.0"):
        entropy(torch.zeros(2, 4), temperature=-1.0)


def test_registry_rejects_duplicate_names():
    from earl_lightning.algorithms import Registry

    reg = Registry("widgets")
    reg.register("a")(1)
    assert reg.get("a", "widget") == 1 and "a" in reg and len(reg) == 1
    with pytest.raises(ValueError, match=r"widgets 'a' is already registered"):
        reg.register("a")(2)
    with pytest.raises(ValueError, match=r"unknown `widget` None; valid widgets: \['a'\]"):
        reg.get(None, "widget")

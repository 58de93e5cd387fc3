"""Policy / value losses and aggregation: hand arithmetic, TRL's GRPO loss, micro-batch equivalence."""

import math

import pytest
import torch

from earl_lightning.algorithms import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    check_clip_args,
    get_loss_aggregation,
    get_policy_loss,
    gspo_loss,
    kl_divergence,
    local_counts,
    ppo_clip_loss,
    value_loss,
)

LN = math.log


def test_ppo_clip_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.7 (token 4 is padding); clip_low 0.2, clip_high 0.3 -> [0.8, 1.3]
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[2.0, 2.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = ppo_clip_loss(ratios.log(), old, adv, mask, clip_low=0.2, clip_high=0.3)
    # t0: max(-2*1.5, -2*1.3) = -2.6 (clipped)   t1: max(-2*0.5, -2*0.8) = -1.0 (unclipped)
    # t2: max(1.1, 1.1) = 1.1                      t3: masked -> 0
    torch.testing.assert_close(loss, torch.tensor([[-2.6, -1.0, 1.1, 0.0]]))
    assert stats.clip_frac.item() == pytest.approx(1 / 3)
    assert stats.ratio_mean.item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert stats.ratio_max.item() == pytest.approx(1.5)
    k3 = [r - 1 - LN(r) for r in (1.5, 0.5, 1.1)]
    assert stats.approx_kl.item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert stats.dual_clip_frac.item() == 0.0


def test_ppo_dual_clip_by_hand():
    # A = -1: ratio 5 -> max(5, 1.2) = 5, capped at dual_clip 3 -> 3. ratio 2 -> 2 (under the cap).
    # A = +1: ratio 5 -> max(-5, -1.2) = -1.2, the dual clip never touches positive advantages.
    ratios = torch.tensor([[5.0, 2.0, 5.0]])
    adv = torch.tensor([-1.0, -1.0, 1.0]).unsqueeze(0)
    loss, stats = ppo_clip_loss(
        ratios.log(), torch.zeros(1, 3), adv, torch.ones(1, 3), dual_clip=3.0
    )
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert stats.dual_clip_frac.item() == pytest.approx(1 / 3)


def test_per_sequence_advantages_broadcast():
    lp = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 0.3
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.ones(3, 5)
    a, _ = ppo_clip_loss(lp, torch.zeros(3, 5), adv, mask)
    b, _ = ppo_clip_loss(lp, torch.zeros(3, 5), adv[:, None].expand(3, 5), mask)
    torch.testing.assert_close(a, b)


def test_gspo_sequence_ratio_by_hand():
    # token log-ratios ln 1.2 and ln 1.2 (+ padding) -> sequence ratio 1.2; clip_high 0.1 -> 1.1
    lp = torch.tensor([[LN(1.2), LN(1.2), 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = gspo_loss(
        lp, torch.zeros(1, 3), torch.tensor([1.0]), mask, clip_low=0.1, clip_high=0.1
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.1, -1.1, 0.0]]))
    assert stats.clip_frac.item() == 1.0


def test_masked_inf_does_not_leak():
    lp = torch.tensor([[0.1, float("nan")]])
    loss, stats = ppo_clip_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]))
    assert torch.isfinite(loss).all() and torch.isfinite(stats.ratio_mean)
    assert torch.isfinite(
        aggregate(torch.tensor([[1.0, float("inf")]]), torch.tensor([[1, 0]]), "token_mean")
    )


# ---- TRL GRPOTrainer._compute_loss, transcribed (trl 1.16.0, grpo_trainer.py) -------------------
def trl_grpo_loss(
    per_token_logps,
    old_per_token_logps,
    ref_per_token_logps,
    advantages,
    mask,
    *,
    loss_type,
    epsilon_low,
    epsilon_high,
    beta,
    max_completion_length,
    importance_sampling_level="token",
):
    """One process, no gradient accumulation, no vLLM, delta/entropy mask/off-policy mask off."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps)
            - (ref_per_token_logps - per_token_logps)
            - 1
        )
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        # one process, one accumulation step, steps_per_generation 1
        num_items_in_batch = mask.sum()
        return (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)
    raise ValueError(loss_type)


TRL_TO_OURS = {  # loss_type -> (aggregation mode, extra kwargs given the mask and max length)
    "grpo": ("seq_mean_token_mean", lambda mask, max_len: {}),
    "bnpo": ("token_mean", lambda mask, max_len: {}),
    "dapo": ("token_mean", lambda mask, max_len: {"num_tokens": mask.sum()}),
    "dr_grpo": ("seq_mean_token_sum_norm", lambda mask, max_len: {"norm_constant": max_len}),
}


def _random_grpo_inputs(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    # ratios well outside the clip
    old = lp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = lp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)  # right-padded completions
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_trl_grpo_loss(loss_type, beta, level):
    lp, old, ref, adv, mask = _random_grpo_inputs(seed=len(loss_type) + int(beta * 100))
    eps_low, eps_high, max_len = (0.2, 0.28, 12) if level == "token" else (3e-4, 4e-4, 12)
    expected = trl_grpo_loss(
        lp,
        old,
        ref,
        adv,
        mask,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        max_completion_length=max_len,
        importance_sampling_level=level,
    )
    (expected_grad,) = torch.autograd.grad(expected, lp)

    policy_loss = get_policy_loss("ppo_clip" if level == "token" else "gspo")
    per_token, stats = policy_loss(lp, old, adv, mask, clip_low=eps_low, clip_high=eps_high)
    # the clip is really exercised
    assert 0.05 < stats.clip_frac.item() < 0.95 or level == "sequence"
    if beta:
        per_token = per_token + beta * kl_divergence(lp, ref, mask, "k3")
    mode, extra = TRL_TO_OURS[loss_type]
    ours = aggregate(per_token, mask, mode, **extra(mask, max_len))
    (ours_grad,) = torch.autograd.grad(ours, lp)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-6, atol=1e-12)


# ---- aggregation ---------------------------------------------------------------------------------
def test_aggregation_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate(v, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(v, mask, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(v, mask, "seq_mean_token_sum_norm").item() == pytest.approx(
        (6 / 4 + 4 / 4) / 2
    )  # T = 4
    assert aggregate(v, mask, "seq_mean_token_sum_norm", norm_constant=10).item() == pytest.approx(
        (0.6 + 0.4) / 2
    )
    assert aggregate(v, mask, "token_mean", num_tokens=20).item() == pytest.approx(10 / 20)
    assert aggregate(v, mask, "seq_mean_token_mean", num_seqs=8).item() == pytest.approx(6 / 8)
    # nothing generated: 0, not nan
    assert aggregate(v, torch.zeros_like(mask), "token_mean").item() == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("ranks,micro", [(1, 3), (2, 2), (4, 1), (2, 3)])
def test_aggregation_over_micro_batches_and_ranks_equals_whole_batch(mode, ranks, micro):
    g = torch.Generator().manual_seed(ranks * 10 + micro)
    B, T = 12, 10
    x = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(0, T + 1, (B,), generator=g)  # includes sequences with no token
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    whole = aggregate(x * 2.5, mask, mode, norm_constant=T)
    (whole_grad,) = torch.autograd.grad(whole, x)

    rows = torch.randperm(B, generator=g).tensor_split(ranks)
    # Global denominators, as a distributed caller gets them: all-reduce (here: sum) the local counts.
    counts = sum(
        local_counts(mask[mb, : int(lengths[mb].max())])
        for r in rows
        for mb in r.tensor_split(micro)
    )
    num_tokens, num_seqs = counts
    assert (num_tokens.item(), num_seqs.item()) == (mask.sum().item(), B)
    total = 0.0
    for rank_rows in rows:
        for mb in rank_rows.tensor_split(micro):
            # each micro-batch padded to its own width
            width = int(lengths[mb].max()) if len(mb) else 0
            part = x[mb, :width] * 2.5
            total = total + aggregate(
                part,
                mask[mb, :width],
                mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                norm_constant=T,
            )
    (total_grad,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(total_grad, whole_grad)


def test_local_denominators_differ_from_global():
    # Without the global counts, a mean of micro-batch means is NOT the batch mean (why they exist).
    v = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    local = (
        aggregate(v[:1], mask[:1], "token_mean") + aggregate(v[1:], mask[1:], "token_mean")
    ) / 2
    assert local.item() == pytest.approx(2.5) and aggregate(
        v, mask, "token_mean"
    ).item() == pytest.approx(7 / 4)


# ---- value loss ----------------------------------------------------------------------------------
def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clip_frac = value_loss(values, old, returns, mask, value_clip=0.5)
    # t0: unclipped (1 - 0)^2 = 1, clipped (0 + 0.5 - 0)^2 = 0.25 -> max 1 -> 0.5
    # t1: unclipped (0 - 1)^2 = 1, clipped (0 + 0 - 1)^2 = 1 -> 0.5;   t2 masked
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.5, 0.0]]))
    assert clip_frac.item() == 0.0
    # clip 0.2, old 0, v = [2.0, 0.3], R = [1.2, -1.0]:
    # t0: unclipped (2 - 1.2)^2 = 0.64, clipped (0.2 - 1.2)^2 = 1.0  -> 1.0 / 2 (clipped active)
    # t1: unclipped (0.3 + 1)^2 = 1.69, clipped (0.2 + 1)^2 = 1.44   -> 1.69 / 2
    loss, clip_frac = value_loss(
        torch.tensor([[2.0, 0.3]]),
        torch.zeros(1, 2),
        torch.tensor([[1.2, -1.0]]),
        torch.ones(1, 2),
        value_clip=0.2,
    )
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.845]]))
    assert clip_frac.item() == 0.5
    v, old, ret, one = (
        torch.tensor([[0.3]]),
        torch.tensor([[0.0]]),
        torch.tensor([[0.5]]),
        torch.ones(1, 1),
    )
    loss, _ = value_loss(v, old, ret, one, value_clip=0.1)
    # unclipped (0.3 - 0.5)^2 = 0.04, clipped (0.1 - 0.5)^2 = 0.16 -> clipped is active
    torch.testing.assert_close(loss, torch.tensor([[0.08]]))
    loss, _ = value_loss(v, old, ret, one, value_clip=None)
    torch.testing.assert_close(loss, torch.tensor([[0.02]]))


# ---- registries and errors -----------------------------------------------------------------------
def test_registries():
    assert {"ppo_clip", "gspo"} <= set(POLICY_LOSSES)  # the built-ins (tests may register more)
    assert set(LOSS_AGGREGATIONS) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
    }
    with pytest.raises(
        ValueError,
        match=r"unknown `policy_loss` 'ppo'; valid policy losses: \[.*'gspo', 'ppo_clip'",
    ):
        get_policy_loss("ppo")
    with pytest.raises(
        ValueError,
        match=r"unknown `loss_aggregation` 'mean'; valid loss aggregations: "
        r"\['seq_mean_token_mean', 'seq_mean_token_sum_norm', 'token_mean'\]",
    ):
        get_loss_aggregation("mean")
    with pytest.raises(ValueError, match=r"unknown `mode` 'sum'; valid loss aggregations"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clip_low=1.0), r"`clip_low` must be a number in \[0, 1\) .*got 1.0"),
        (dict(clip_high=-0.1), r"`clip_high` must be a number >= 0, got -0.1"),
        (dict(dual_clip=1.0), r"`dual_clip` must be a number > 1 or None, got 1.0"),
    ],
)
def test_clip_args_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_clip_args(**(dict(clip_low=0.2, clip_high=0.2, dual_clip=None) | kwargs))
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), **kwargs
        )


def test_bad_shapes_rejected():
    z = torch.zeros(2, 3)
    with pytest.raises(
        ValueError,
        match=r"`advantages` has shape \(3,\), expected \(2, 3\) \(per token\) or \(2,\)",
    ):
        ppo_clip_loss(z, z, torch.zeros(3), z)
    with pytest.raises(
        ValueError, match=r"`old_logprobs` has shape \(2, 4\), expected \(2, 3\) like `logprobs`"
    ):
        gspo_loss(z, torch.zeros(2, 4), torch.zeros(2), z)
    with pytest.raises(ValueError, match=r"`logprobs` must be 2-D \[B, T\], got shape \(3,\)"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(
        ValueError, match=r"`returns` has shape \(2,\), expected \(2, 3\) like `values`"
    ):
        value_loss(z, z, torch.zeros(2), z)
    with pytest.raises(ValueError, match=r"`value_clip` must be a number >= 0, got -1"):
        value_loss(z, z, z, z, value_clip=-1)
    with pytest.raises(
        ValueError,
        match=r"`num_tokens` must be a number >= 0 \(the global denominator\) or None, got -3",
    ):
        aggregate(z, z, "token_mean", num_tokens=-3)
    with pytest.raises(ValueError, match=r"`norm_constant` must be a positive number, got 0"):
        aggregate(z, z, "seq_mean_token_sum_norm", norm_constant=0)
    with pytest.raises(
        ValueError, match=r"`mask` has shape \(2,\), expected \(2, 3\) like `token_values`"
    ):
        aggregate(z, torch.zeros(2), "token_mean")

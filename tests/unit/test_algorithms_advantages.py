"""Advantage estimators against hand arithmetic, plain-loop references, and the Moments path."""

import math

import pytest
import torch

from earl_lightning.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    Moments,
    discounted_returns,
    gae_advantages,
    get_advantage_estimator,
    grouped_moments,
    grpo_advantages,
    moments,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)

# Group 0 = rewards {3, 1} (positions 1, 3), group 1 = {0, 0, 6} (positions 0, 2, 4); both means are 2.
REWARDS = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0])
GROUPS = torch.tensor([1, 0, 1, 0, 1])


def test_grpo_group_scale_by_hand():
    # group 0: centered {+1, -1}, unbiased var = (1 + 1) / 1 = 2  -> std sqrt(2)
    # group 1: centered {-2, -2, +4}, unbiased var = (4 + 4 + 16) / 2 = 12 -> std 2 sqrt(3)
    s0, s1 = math.sqrt(2), 2 * math.sqrt(3)
    expected = torch.tensor([-2 / s1, 1 / s0, -2 / s1, -1 / s0, 4 / s1])
    got = grpo_advantages(REWARDS, GROUPS, num_groups=2, eps=0.0)
    torch.testing.assert_close(got, expected)


def test_grpo_batch_and_none_scale_by_hand():
    # batch of {0, 3, 0, 1, 6}: mean 2, unbiased var = (4 + 1 + 4 + 1 + 16) / 4 = 6.5
    centered = torch.tensor([-2.0, 1.0, -2.0, -1.0, 4.0])  # minus the GROUP mean, 2 in both groups
    got = grpo_advantages(REWARDS, GROUPS, num_groups=2, scale="batch", eps=0.0)
    torch.testing.assert_close(got, centered / math.sqrt(6.5))
    torch.testing.assert_close(
        grpo_advantages(REWARDS, GROUPS, num_groups=2, scale="none"), centered
    )


def test_grpo_eps_and_degenerate_groups():
    # All-equal group: std 0, so the advantage is 0 / eps = 0. A group of one: std 0 too.
    r = torch.tensor([1.0, 1.0, 5.0])
    g = torch.tensor([0, 0, 1])
    torch.testing.assert_close(grpo_advantages(r, g, num_groups=2), torch.zeros(3))
    # eps enters as std + eps: centered +-0.5, std sqrt(0.5)
    r = torch.tensor([0.0, 1.0])
    got = grpo_advantages(r, torch.tensor([0, 0]), num_groups=1, eps=0.1)
    torch.testing.assert_close(got, torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 0.1))


def test_rloo_by_hand():
    # group 0 {3, 1}: 3 - 1, 1 - 3. group 1 {0, 0, 6}: 0 - 3, 0 - 3, 6 - 0.
    got = rloo_advantages(REWARDS, GROUPS, num_groups=2)
    torch.testing.assert_close(got, torch.tensor([-3.0, 2.0, -3.0, -2.0, 6.0]))
    assert rloo_advantages(torch.tensor([4.0]), torch.tensor([0]), num_groups=1).item() == 0.0


def test_moments_by_hand():
    m = moments(torch.tensor([[1.0, 2.0], [3.0, 100.0]]), torch.tensor([[1, 1], [1, 0]]))
    assert (m.sum.item(), m.sumsq.item(), m.count.item()) == (6.0, 14.0, 3.0)
    assert (
        m.mean().item() == 2.0
        and m.var().item() == 1.0
        and m.var(unbiased=False).item() == pytest.approx(2 / 3)
    )
    g = grouped_moments(REWARDS, GROUPS, num_groups=3)  # group 2 is empty
    torch.testing.assert_close(g.sum, torch.tensor([4.0, 6.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(g.count, torch.tensor([2.0, 3.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(
        g.std(), torch.tensor([math.sqrt(2), math.sqrt(12), 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(Moments.unpack(g.pack()).sumsq, g.sumsq)


def test_masked_padding_with_nan_is_ignored():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    assert moments(x, mask).mean().item() == 2.0
    out = whiten(x, mask)
    assert torch.isfinite(out).all() and out[0, 1] == 0 and out[1, 1] == 0


def _chunks(n: int, k: int, seed: int) -> list[torch.Tensor]:
    """A random partition of range(n) into k non-empty index sets (ranks x micro-batches)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return list(perm.tensor_split(k))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_moments_path_equals_local(k, scale):
    g = torch.Generator().manual_seed(k)
    num_groups, per_group = 5, 4
    rewards = torch.randn(num_groups * per_group, generator=g) * 3 + 1
    ids = torch.arange(num_groups).repeat_interleave(per_group)
    full = grpo_advantages(rewards, ids, num_groups=num_groups, scale=scale)
    parts = _chunks(len(rewards), k, seed=k)
    # What a distributed caller does: local moments per shard, summed (all-reduce), then passed in.
    group = sum(
        (grouped_moments(rewards[p], ids[p], num_groups) for p in parts[1:]),
        grouped_moments(rewards[parts[0]], ids[parts[0]], num_groups),
    )
    batch = sum((moments(rewards[p]) for p in parts[1:]), moments(rewards[parts[0]]))
    for p in parts:
        got = grpo_advantages(
            rewards[p], ids[p], num_groups=num_groups, scale=scale, group=group, batch=batch
        )
        torch.testing.assert_close(got, full[p], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4])
def test_rloo_moments_path_equals_local(k):
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(3).repeat(4)
    full = rloo_advantages(rewards, ids, num_groups=3)
    parts = _chunks(12, k, seed=1)
    group = grouped_moments(rewards[parts[0]], ids[parts[0]], 3)
    for p in parts[1:]:
        group = group + grouped_moments(rewards[p], ids[p], 3)
    for p in parts:
        torch.testing.assert_close(
            rloo_advantages(rewards[p], ids[p], num_groups=3, group=group), full[p]
        )


def test_outcome_to_token_rewards():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    got = outcome_to_token_rewards(torch.tensor([2.0, -1.0, 7.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 1] = 2.0, -1.0  # the empty row has nowhere to put its 7
    torch.testing.assert_close(got, expected)


def test_discounted_returns_skip_observation_tokens_by_hand():
    # generated tokens at 1, 2, 4 (3 is an observation, its reward 9 must be ignored), gamma 0.5
    r = torch.tensor([[0.0, 1.0, 0.0, 9.0, 4.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]])
    # G4 = 4; G2 = 0 + 0.5 * 4 = 2; G1 = 1 + 0.5 * 2 = 2
    torch.testing.assert_close(
        discounted_returns(r, mask, gamma=0.5), torch.tensor([[0.0, 2.0, 2.0, 0.0, 4.0, 0.0]])
    )
    # gamma 1 takes the cumulative-sum path: G4 = 4, G2 = 4, G1 = 5
    torch.testing.assert_close(
        discounted_returns(r, mask), torch.tensor([[0.0, 5.0, 4.0, 0.0, 4.0, 0.0]])
    )


def test_reinforce_pp_by_hand():
    # returns over the masked tokens: row 0 -> {3, 3}, row 1 -> {0, 0, 0}... use gamma 1:
    r = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    # returns: row 0 = [3, 3, 2], row 1 = [_, -1, -1]; over 5 tokens mean 6/5 = 1.2,
    # unbiased var = (1.8^2 * 2 + 0.8^2 + 2.2^2 * 2) / 4 = (6.48 + 0.64 + 9.68) / 4 = 4.2
    std = math.sqrt(4.2 + 1e-8)
    expected = torch.tensor([[1.8, 1.8, 0.8], [0.0, -2.2, -2.2]]) / std
    expected[1, 0] = 0.0
    torch.testing.assert_close(reinforce_pp_advantages(r, mask), expected)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_reinforce_pp_moments_path_equals_local(k):
    g = torch.Generator().manual_seed(k)
    B, T = 8, 11
    mask = (torch.rand(B, T, generator=g) < 0.6).long()
    rewards = outcome_to_token_rewards(torch.randn(B, generator=g), mask)
    rewards = rewards - 0.01 * torch.rand(B, T, generator=g)  # a per-token KL penalty
    full = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    parts = _chunks(B, k, seed=k)
    batch = None
    for p in parts:
        local = moments(discounted_returns(rewards[p], mask[p], gamma=0.9), mask[p])
        batch = local if batch is None else batch + local
    for p in parts:
        got = reinforce_pp_advantages(rewards[p], mask[p], gamma=0.9, batch=batch)
        torch.testing.assert_close(got, full[p], rtol=1e-6, atol=1e-6)


def _gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE, one episode at a time, over the list of its generated tokens."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_value = float(values[b, t])
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
def test_gae_against_plain_loop(gamma, lam):
    g = torch.Generator().manual_seed(3)
    B, T = 5, 13
    mask = (torch.rand(B, T, generator=g) < 0.5).long()
    mask[0] = 0  # an episode with nothing generated
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.where(mask.bool(), expected + values, 0.0))


def test_gae_by_hand():
    # generated tokens 1, 2, 4 with rewards 1, 0, 2 and values 0.5, 0, 0.3; gamma 0.9, lam 0.8
    r = torch.tensor([[0.0, 1.0, 0.0, 5.0, 2.0]])
    v = torch.tensor([[9.0, 0.5, 0.0, 9.0, 0.3]])
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    a4 = 2 - 0.3  # terminal: next value 0
    a2 = (0 + 0.9 * 0.3 - 0) + 0.72 * a4
    a1 = (1 + 0.9 * 0.0 - 0.5) + 0.72 * a2
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, a1, a2, 0.0, a4]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, a1 + 0.5, a2, 0.0, a4 + 0.3]]))


def test_registry_lookup_and_unknown_name():
    # the built-ins (tests may register more in the same process)
    assert {"grpo", "rloo", "reinforce_pp", "gae"} <= set(ADVANTAGE_ESTIMATORS)
    gae = get_advantage_estimator("gae")
    assert gae.needs_values and not get_advantage_estimator("grpo").needs_values
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = gae(
        AdvantageInputs(
            rewards=torch.zeros(1),
            group_ids=torch.zeros(1, dtype=torch.long),
            num_groups=1,
            episode_rows=torch.ones(1, dtype=torch.bool),
            token_rewards=torch.tensor([[0, 0, 1.0]]),
            mask=mask,
            values=torch.tensor([[0, 0.5, 0.25]]),
        ),
        gamma=0.5,
        lam=1.0,
    )
    expected = gae_advantages(
        torch.tensor([[0, 0, 1.0]]), torch.tensor([[0, 0.5, 0.25]]), mask, gamma=0.5, lam=1.0
    )
    torch.testing.assert_close(out.advantages, expected[0])
    torch.testing.assert_close(out.returns, expected[1])
    with pytest.raises(
        ValueError,
        match=r"unknown `advantage_estimator` 'ppo'; "
        r"valid advantage estimators: \['gae', 'gigpo', 'grpo'",
    ):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match=r"unknown `algo.adv` 'x'"):
        get_advantage_estimator("x", arg="algo.adv")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(scale="std"), r"`scale` must be one of \['group', 'batch', 'none'\], got 'std'"),
        (dict(eps=-1.0), r"`eps` must be a number >= 0, got -1.0"),
        (dict(num_groups=0), r"`num_groups` must be a positive integer, got 0"),
        (
            dict(num_groups=1),
            r"`group_ids` must lie in \[0, num_groups=1\), got values in \[0, 1\]",
        ),
        (
            dict(group_ids=torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])),
            r"`group_ids` must be an integer tensor",
        ),
        (dict(group_ids=torch.tensor([0, 1])), r"`group_ids` has shape \(2,\), expected \(5,\)"),
        (dict(rewards=torch.zeros(5, 2)), r"`rewards` must be 1-D \[S\]"),
        (
            dict(group=Moments(torch.zeros(3), torch.zeros(3), torch.zeros(3))),
            r"`group` moments have shape \(3,\), expected \(2,\)",
        ),
    ],
)
def test_grpo_bad_inputs(kwargs, match):
    args = dict(rewards=REWARDS, group_ids=GROUPS, num_groups=2) | kwargs
    with pytest.raises(ValueError, match=match):
        grpo_advantages(args.pop("rewards"), args.pop("group_ids"), **args)


def test_token_estimators_bad_inputs():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"`gamma` must be a number in \[0, 1\], got 1.5"):
        reinforce_pp_advantages(r, m, gamma=1.5)
    with pytest.raises(ValueError, match=r"`lam` must be a number in \[0, 1\], got -0.1"):
        gae_advantages(r, r, m, lam=-0.1)
    with pytest.raises(
        ValueError, match=r"`values` has shape \(2, 4\), expected \(2, 3\) like `token_rewards`"
    ):
        gae_advantages(r, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match=r"`token_rewards` must be 2-D \[B, T\], got shape \(3,\)"):
        reinforce_pp_advantages(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"`eps` must be a positive number, got 0"):
        reinforce_pp_advantages(r, m, eps=0)
    with pytest.raises(
        ValueError, match=r"`rewards` has shape \(3,\), expected \(2,\): one per row of `mask`"
    ):
        outcome_to_token_rewards(torch.zeros(3), m)
    with pytest.raises(ValueError, match=r"`batch` moments have shape \(2,\), expected \(\)"):
        reinforce_pp_advantages(r, m, batch=Moments(torch.zeros(2), torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ValueError, match=r"Moments fields must share one shape"):
        Moments(torch.zeros(2), torch.zeros(2), torch.zeros(()))

"""Advantage estimators: GRPO (and RLOO) group baselines, REINFORCE++, GAE.

Shapes: ``S`` sequences (episodes), ``B`` rows of a padded batch, ``T`` padded width. Token tensors
follow batches/experience.py: ``mask[b, t] = 1`` iff the policy generated token ``t``; everything else
(prompt, environment observations, padding) is not a step of the policy and gets advantage 0.

The registered, uniform estimators built on these functions live in :mod:`.estimators`.
Estimators that normalize over a set spread across ranks (a group, the batch) take optional
:class:`Moments`. The local call computes local moments and then runs the very same code, so a
distributed caller that all-reduces the local moments gets the single-process answer.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from earl_lightning.algorithms._checks import check_2d, check_same_shape
from earl_lightning.algorithms.moments import (
    STAT_DTYPE,
    Moments,
    check_group_ids,
    grouped_moments,
    moments,
)
from earl_lightning.core.checks import check_choice, check_number

GRPO_SCALES = ("group", "batch", "none")
GrpoScale = Literal["group", "batch", "none"]


# ---- outcome-level (one reward per sequence) ----------------------------------------------------
def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    num_groups: int,
    scale: GrpoScale = "group",
    eps: float = 1e-6,
    group: Moments | None = None,
    batch: Moments | None = None,
) -> Tensor:
    """GRPO: ``(r - mean of r's group) / (std + eps)`` -> [S].

    ``rewards`` [S], ``group_ids`` [S] int64 in ``[0, num_groups)``. ``std`` is the unbiased std of
    the sequence's group (``scale="group"``, GRPO) or of the whole batch (``"batch"``); ``"none"``
    (Dr. GRPO) returns ``r - group mean`` undivided. ``group`` ([G] fields) and ``batch`` (scalar
    fields) replace the local moments when given, e.g. after an all-reduce across ranks. A group of
    one has std 0, so its only member gets advantage 0.
    """
    check_choice("scale", scale, GRPO_SCALES)
    check_number("eps", eps, low=0)
    check_group_ids(group_ids, num_groups, like=rewards, like_name="rewards")
    group = grouped_moments(rewards, group_ids, num_groups) if group is None else group
    _check_moments_shape("group", group, (num_groups,))
    if scale == "batch":
        batch = moments(rewards) if batch is None else batch
        _check_moments_shape("batch", batch, ())
    return _normalize_in_groups(rewards, group_ids.long(), group, batch, scale, eps)


def _normalize_in_groups(
    rewards: Tensor, ids: Tensor, group: Moments, batch: Moments | None, scale: str, eps: float
) -> Tensor:
    """The one normalization both the local and the distributed GRPO paths run."""
    centered = rewards.detach().to(STAT_DTYPE) - group.mean()[ids]  # [S]
    if scale == "none":
        return centered.to(rewards.dtype)
    std = group.std()[ids] if scale == "group" else batch.std().expand_as(centered)  # [S]
    return (centered / (std + eps)).to(rewards.dtype)


def anchor_state_advantages(
    returns: Tensor,
    state_keys: Tensor,
    valid: Tensor,
    *,
    scale: GrpoScale = "group",
    eps: float = 1e-6,
) -> Tensor:
    """GiGPO's step-level advantage (Feng et al., 2025, arXiv 2505.10978) -> [R].

    ``returns`` [R]: each turn row's discounted return from that turn on; ``state_keys`` [R] int64:
    equal for the rows of one group that acted in the same state (an *anchor state*); ``valid`` [R]
    bool: rows that generated something. A valid row gets its return minus the mean return of the
    valid rows sharing its key, divided by their std (``scale="group"``), by the std of every valid
    return (``"batch"``) or not at all (``"none"``). A state visited by one row, and every invalid
    row, gets 0. Rows are local: the caller keeps each group's rows together.
    """
    check_choice("scale", scale, GRPO_SCALES)
    check_number("eps", eps, low=0)
    check_same_shape("returns", returns, state_keys=state_keys, valid=valid)
    if returns.dim() != 1:
        raise ValueError(
            f"`returns` must be 1-D [R] (one per turn row), got shape {tuple(returns.shape)}"
        )
    out = torch.zeros_like(returns, dtype=STAT_DTYPE)
    keep = valid.bool()
    if not keep.any():
        return out.to(returns.dtype)
    r = returns.detach().to(STAT_DTYPE)[keep]
    _, ids = torch.unique(state_keys[keep], return_inverse=True)
    states = grouped_moments(r, ids, int(ids.max()) + 1)
    centered = r - states.mean()[ids]
    if scale == "group":
        centered = centered / (states.std()[ids] + eps)
    elif scale == "batch":
        centered = centered / (moments(r).std() + eps)
    out[keep] = centered
    return out.to(returns.dtype)


def rloo_advantages(
    rewards: Tensor, group_ids: Tensor, *, num_groups: int, group: Moments | None = None
) -> Tensor:
    """RLOO: ``r_i - mean of the OTHER rewards of i's group`` -> [S] (0 for a group of one).

    ``rewards`` [S], ``group_ids`` [S]; ``group`` ([G] fields) replaces the local group moments.
    """
    check_group_ids(group_ids, num_groups, like=rewards, like_name="rewards")
    group = grouped_moments(rewards, group_ids, num_groups) if group is None else group
    _check_moments_shape("group", group, (num_groups,))
    ids = group_ids.long()
    r = rewards.detach().to(STAT_DTYPE)
    n = group.count[ids]
    baseline = (group.sum[ids] - r) / (n - 1).clamp(min=1)
    return torch.where(n > 1, r - baseline, torch.zeros_like(r)).to(rewards.dtype)


def _check_moments_shape(name: str, m: Moments, shape: tuple[int, ...]) -> None:
    if tuple(m.sum.shape) != shape:
        raise ValueError(f"`{name}` moments have shape {tuple(m.sum.shape)}, expected {shape}")


# ---- token-level ---------------------------------------------------------------------------------
def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's outcome reward on its last generated token.

    ``rewards`` [B], ``mask`` [B, T] -> [B, T] (zeros elsewhere). A row without any generated token
    has nowhere to put its reward: it stays all-zero (it has no token to train anyway).
    """
    check_2d("mask", mask)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"`rewards` has shape {tuple(rewards.shape)}, expected ({mask.shape[0]},): one per row of `mask`"
        )
    keep = mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(keep, positions, -1).max(dim=1).values  # [B], -1 when the row is empty
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = (last >= 0).nonzero().squeeze(1)
    out[rows, last[rows]] = rewards[rows]
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Returns-to-go over the generated tokens of each row: [B, T] -> [B, T].

    ``G_t = r_t + gamma * G_next`` where ``next`` is the next *generated* token of the row:
    observation tokens between turns are not steps, so they neither discount nor earn (their
    rewards are ignored) and their return is 0.
    """
    check_2d("token_rewards", token_rewards)
    check_same_shape("token_rewards", token_rewards, mask=mask)
    check_number("gamma", gamma, low=0, high=1)
    keep = mask.bool()
    r = torch.where(keep, token_rewards.detach(), torch.zeros_like(token_rewards))
    if gamma == 1.0:
        # Undiscounted: a reversed cumulative sum, no Python loop over a 32K-token context.
        return torch.where(keep, r.flip(1).cumsum(1).flip(1), torch.zeros_like(r))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])  # [B]
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(keep[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    return out


def whiten(x: Tensor, mask: Tensor, stats: Moments | None = None, *, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased var), 0 elsewhere.

    ``x``, ``mask`` of one shape; ``stats`` (scalar fields) replaces the local moments when given.
    """
    check_same_shape("x", x, mask=mask)
    check_number("eps", eps, low=0, strict=True)
    if stats is None:
        stats = moments(x, mask)
    _check_moments_shape("batch", stats, ())
    out = (x.detach().to(STAT_DTYPE) - stats.mean()) * torch.rsqrt(stats.var() + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out)).to(x.dtype)


def reinforce_pp_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
    batch: Moments | None = None,
) -> Tensor:
    """REINFORCE++: whitened returns-to-go, [B, T] -> [B, T].

    ``token_rewards`` [B, T] hold the outcome reward on each row's last generated token (see
    :func:`outcome_to_token_rewards`) minus any per-token KL penalty (see
    ``kl.kl_penalized_rewards``). Returns are whitened over all masked tokens of the batch;
    ``batch`` (scalar moments of the *returns*, e.g. all-reduced) replaces the local ones.
    """
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return whiten(returns, mask, batch, eps=eps)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the generated tokens: -> (advantages, returns), [B, T] each.

    ``values`` [B, T] is the value head's estimate at each generated token. The steps of a row are
    its generated tokens in order; the token after the last one is terminal (value 0), and
    observation tokens in between are skipped. ``returns = advantages + values`` (the value target).
    """
    check_2d("token_rewards", token_rewards)
    check_same_shape("token_rewards", token_rewards, values=values, mask=mask)
    check_number("gamma", gamma, low=0, high=1)
    check_number("lam", lam, low=0, high=1)
    keep = mask.bool()
    r, v = token_rewards.detach(), values.detach().to(token_rewards.dtype)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # [B] value of the next step (0 after the last)
    next_adv = torch.zeros_like(r[:, 0])  # [B]
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        # Non-generated tokens carry the next step's value and advantage through unchanged.
        next_adv = torch.where(keep[:, t], a_t, next_adv)
        next_value = torch.where(keep[:, t], v[:, t], next_value)
        adv[:, t] = torch.where(keep[:, t], a_t, torch.zeros_like(a_t))
    returns = torch.where(keep, adv + v, torch.zeros_like(adv))
    return adv, returns

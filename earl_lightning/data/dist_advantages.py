"""Distributed advantage estimation: rewards never leave their rank.

A GRPO group or a REINFORCE++ batch is spread across data-parallel ranks after the dispatcher ran.
Its mean and std need only sums and counts, which add up across ranks: each rank computes the
:class:`~earl_lightning.algorithms.moments.Moments` of its shard, one ``all_reduce`` sums them, and
the pure estimators in ``earl_lightning.algorithms`` run on the global moments — the same code the
single-process path runs, so the result equals it (up to float64 summation order).

Under a layout with tensor parallelism the members of a TP group hold identical rows; pass that
``layout`` and only TP rank 0 of each group contributes, so nothing is counted twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from earl_lightning.algorithms.advantages import (
    GRPO_SCALES,
    GrpoScale,
    discounted_returns,
    grpo_advantages,
    reinforce_pp_advantages,
)
from earl_lightning.algorithms.moments import STAT_DTYPE, Moments, grouped_moments, moments
from earl_lightning.parallel.layout import Layout


def _contributes(layout: Layout | None, group: dist.ProcessGroup | None) -> bool:
    if layout is None:
        return True
    layout.check_world(dist.get_world_size(group), arg="layout")
    return layout.coords(dist.get_rank(group))[1] == 0


def all_reduce_moments(parts: list[Moments], *, group: dist.ProcessGroup | None = None,
                       layout: Layout | None = None) -> list[Moments]:
    """Sum each of ``parts`` over the ranks of ``group`` with ONE ``all_reduce`` (float64)."""
    packed = [m.pack().reshape(3, -1) for m in parts]  # [3, numel] each
    flat = torch.cat(packed, dim=1)
    if not _contributes(layout, group):
        flat = torch.zeros_like(flat)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, start = [], 0
    for m, p in zip(parts, packed):
        chunk = flat[:, start:start + p.shape[1]].reshape(3, *m.sum.shape)
        out.append(Moments.unpack(chunk))
        start += p.shape[1]
    return out


def dist_grpo_advantages(rewards: Tensor, group_ids: Tensor, *, num_groups: int, scale: GrpoScale = "group",
                         eps: float = 1e-6, group: dist.ProcessGroup | None = None,
                         layout: Layout | None = None) -> Tensor:
    """GRPO advantages of this rank's sequences with group (and batch) statistics over all ranks.

    ``rewards`` [S_local], ``group_ids`` [S_local] global ids in ``[0, num_groups)`` -> [S_local].
    Equals ``grpo_advantages`` on the concatenation of every rank's rows.
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"`scale` must be one of {list(GRPO_SCALES)}, got {scale!r}")
    local_group = grouped_moments(rewards, group_ids, num_groups)
    local_batch = moments(rewards)
    group_m, batch_m = all_reduce_moments([local_group, local_batch], group=group, layout=layout)
    return grpo_advantages(rewards, group_ids, num_groups=num_groups, scale=scale, eps=eps,
                           group=group_m, batch=batch_m)


def dist_reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8,
                                 group: dist.ProcessGroup | None = None,
                                 layout: Layout | None = None) -> Tensor:
    """REINFORCE++ advantages [B_local, T] whitened with the mean/std of the returns over every
    rank's generated tokens. Returns-to-go stay within a row, so only the whitening is global."""
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    (batch_m,) = all_reduce_moments([moments(returns, mask)], group=group, layout=layout)
    return reinforce_pp_advantages(token_rewards, mask, gamma=gamma, eps=eps, batch=batch_m)


def dist_num_groups(group_ids: Tensor, *, group: dist.ProcessGroup | None = None) -> int:
    """``max(group id) + 1`` over all ranks: the ``num_groups`` every rank must pass."""
    top = torch.tensor([int(group_ids.max()) + 1 if group_ids.numel() else 0], dtype=STAT_DTYPE)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return int(top.item())

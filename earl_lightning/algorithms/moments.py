"""Sufficient statistics (sum, sum of squares, count) for means and standard deviations.

Normalizing advantages needs a mean and a std over a set that a distributed batch spreads over many
ranks (a GRPO group, the whole batch). Sums add up across ranks, so a caller all-reduces the
:class:`Moments` of its local shard and passes them in; the estimators then run exactly the code
they run on local moments. Sums are kept in float64 because ``sumsq - sum**2 / n`` cancels badly in
float32 once a batch holds millions of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from earl_lightning.core.checks import check_count

STAT_DTYPE = torch.float64


@dataclass
class Moments:
    """Element-wise moments; every field has the same shape (``[]`` for a scalar, ``[G]`` per group).

    Raises:
        ValueError: the three fields' shapes differ.
    """

    sum: Tensor
    sumsq: Tensor
    count: Tensor

    def __post_init__(self) -> None:
        shapes = {tuple(self.sum.shape), tuple(self.sumsq.shape), tuple(self.count.shape)}
        if len(shapes) != 1:
            raise ValueError(
                f"Moments fields must share one shape, got sum {tuple(self.sum.shape)}, "
                f"sumsq {tuple(self.sumsq.shape)}, count {tuple(self.count.shape)}"
            )

    def __add__(self, other: Moments) -> Moments:
        return Moments(self.sum + other.sum, self.sumsq + other.sumsq, self.count + other.count)

    def mean(self) -> Tensor:
        """Mean; 0 where the count is 0."""
        return self.sum / self.count.clamp(min=1)

    def var(self, unbiased: bool = True) -> Tensor:
        """Variance; 0 where there are too few elements (a group of one has no spread)."""
        n = self.count
        centered = (self.sumsq - self.sum * self.sum / n.clamp(min=1)).clamp(min=0)
        return centered / (n - 1 if unbiased else n).clamp(min=1)

    def std(self, unbiased: bool = True) -> Tensor:
        """Standard deviation, the square root of :meth:`var` (0 where that is 0)."""
        return self.var(unbiased).sqrt()

    def pack(self) -> Tensor:
        """``[3, *shape]`` float64, so a caller needs one ``all_reduce`` instead of three."""
        return torch.stack([self.sum, self.sumsq, self.count.to(STAT_DTYPE)])

    @classmethod
    def unpack(cls, packed: Tensor) -> Moments:
        """Inverse of :meth:`pack`."""
        if packed.dim() < 1 or packed.shape[0] != 3:
            raise ValueError(f"packed moments must have shape [3, ...], got {tuple(packed.shape)}")
        return cls(packed[0], packed[1], packed[2])


def moments(x: Tensor, mask: Tensor | None = None) -> Moments:
    """Scalar moments of ``x`` (any shape) over the entries where ``mask`` (same shape) is nonzero."""
    x = x.detach().to(STAT_DTYPE)
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    elif mask.shape != x.shape:
        raise ValueError(
            f"`mask` has shape {tuple(mask.shape)}, expected {tuple(x.shape)} like `x`"
        )
    keep = mask.bool()
    # torch.where, not x * mask: padding may hold inf/nan that must not leak into the sums.
    xm = torch.where(keep, x, torch.zeros((), dtype=STAT_DTYPE, device=x.device))
    return Moments(xm.sum(), (xm * xm).sum(), keep.sum().to(STAT_DTYPE))


def grouped_moments(x: Tensor, group_ids: Tensor, num_groups: int) -> Moments:
    """Per-group moments: ``x`` [S], ``group_ids`` [S] int64 in ``[0, num_groups)`` -> fields [G]."""
    check_group_ids(group_ids, num_groups, like=x, like_name="x")
    x = x.detach().to(STAT_DTYPE)
    ids = group_ids.long()
    zeros = torch.zeros(num_groups, dtype=STAT_DTYPE, device=x.device)
    return Moments(
        zeros.index_add(0, ids, x),
        zeros.index_add(0, ids, x * x),
        zeros.index_add(0, ids, torch.ones_like(x)),
    )


def check_group_ids(group_ids: Tensor, num_groups: int, like: Tensor, like_name: str) -> None:
    """Raise a ValueError unless ``like`` (the argument ``like_name``) is [S] and ``group_ids`` is a
    [S] integer tensor with values in ``[0, num_groups)``."""
    check_count("num_groups", num_groups)
    if like.dim() != 1:
        raise ValueError(
            f"`{like_name}` must be 1-D [S] (one per sequence), got shape {tuple(like.shape)}"
        )
    if group_ids.shape != like.shape:
        raise ValueError(
            f"`group_ids` has shape {tuple(group_ids.shape)}, expected {tuple(like.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"`group_ids` must be an integer tensor, got dtype {group_ids.dtype}")
    if group_ids.numel() and (int(group_ids.min()) < 0 or int(group_ids.max()) >= num_groups):
        raise ValueError(
            f"`group_ids` must lie in [0, num_groups={num_groups}), got values in "
            f"[{int(group_ids.min())}, {int(group_ids.max())}]"
        )

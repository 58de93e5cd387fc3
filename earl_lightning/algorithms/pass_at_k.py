"""pass@k from ``n`` samples per problem: the unbiased estimator of Chen et al. (2021, eq. 1).

Drawing ``k`` of a row's ``n`` samples, ``c`` of them correct, the chance that none of the ``k``
is correct is ``C(n - c, k) / C(n, k)``; pass@k is one minus that, averaged over rows. Taking the
best of exactly ``k`` samples instead would be biased low for ``k < n`` and noisier.
"""

from __future__ import annotations

import torch
from torch import Tensor

from earl_lightning.core.checks import check_count


def pass_at_k(n: Tensor, c: Tensor, k: int) -> Tensor:
    """``1 - C(n - c, k) / C(n, k)`` per row, [R] float64, for ``n`` [R] samples of which ``c`` [R]
    are correct (``0 <= c <= n``, ``k <= n``); 1 where fewer than ``k`` samples are wrong."""
    check_count("k", k)
    n, c = n.to(torch.float64), c.to(torch.float64)
    if n.shape != c.shape:
        raise ValueError(f"`c` has shape {tuple(c.shape)}, expected {tuple(n.shape)} like `n`")
    if bool((c < 0).any() | (c > n).any() | (n < k).any()):
        raise ValueError(f"pass@{k} needs 0 <= c <= n and n >= {k} on every row")
    # C(n - c, k) / C(n, k) = prod over i = n - c + 1 .. n of (1 - k / i): exactly 1 when c = 0, and
    # 0 when n - c < k (the factor at i = k is 0)
    none = torch.ones_like(n)
    for j in range(int(c.max()) if c.numel() else 0):
        none = torch.where(j < c, none * (1.0 - k / (n - j).clamp(min=1)), none)
    return 1.0 - none

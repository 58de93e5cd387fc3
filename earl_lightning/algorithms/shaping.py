"""Reward shaping by length: DAPO's soft overlong punishment (Yu et al., 2025, eq. 13).

A completion cut at the length limit is usually wrong for being cut, not for its reasoning; a
hard penalty at the limit punishes both alike. The soft one grows linearly over the last
``buffer`` tokens before ``max_tokens``, so the policy learns to stay short of the limit.
"""

from __future__ import annotations

from torch import Tensor

from earl_lightning.core.checks import check_count, check_number


def overlong_penalty(
    lengths: Tensor, *, max_tokens: int, buffer: int, penalty: float = 1.0
) -> Tensor:
    """The reward added to each sequence [B] of ``lengths`` [B] generated tokens: 0 up to
    ``max_tokens - buffer``, then falling linearly to ``-penalty`` at ``max_tokens``, and
    ``-penalty`` beyond it. (DAPO's ``L_max`` is ``max_tokens``, its ``L_cache`` is ``buffer``.)"""
    check_count("max_tokens", max_tokens)
    check_count("buffer", buffer)
    check_number("penalty", penalty, low=0)
    if buffer > max_tokens:
        raise ValueError(f"`buffer` ({buffer}) must be at most `max_tokens` ({max_tokens})")
    over = (lengths - (max_tokens - buffer)).clamp(min=0, max=buffer)  # [B]: tokens into the buffer
    return -penalty * over / buffer

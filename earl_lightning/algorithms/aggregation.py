"""Loss aggregation: how per-token losses [B, T] become one scalar.

Micro-batched and data-parallel training computes the loss of one slice of the batch at a time and
sums the gradients (over micro-batches, then over ranks by all-reduce sum). To make that sum equal
the loss of the whole batch at once, every mode divides by a *global* denominator: pass the number
of masked tokens (``num_tokens``) or sequences (``num_seqs``) of the whole optimizer-step batch,
across all micro-batches and ranks. Left as None they default to this slice's own counts, which is
right only when the slice is the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from earl_lightning.algorithms._checks import check_2d, check_same_shape
from earl_lightning.core.checks import check_number
from earl_lightning.core.registry import Registry

Number = int | float | Tensor
AggregationFn = Callable[
    [Tensor, Tensor, "Number | None", "Number | None", "Number | None"], Tensor
]
LOSS_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregations")
AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def get_loss_aggregation(name: str, arg: str = "loss_aggregation") -> AggregationFn:
    """The aggregation registered as ``name``; an unknown name lists the valid ones."""
    return LOSS_AGGREGATIONS.get(name, arg)


def aggregate(
    token_values: Tensor,
    mask: Tensor,
    mode: AggregationMode,
    *,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    norm_constant: Number | None = None,
) -> Tensor:
    """Aggregate ``token_values`` [B, T] over ``mask`` [B, T] -> scalar.

    Modes: ``"token_mean"`` (DAPO: sum over masked tokens / ``num_tokens``),
    ``"seq_mean_token_mean"`` (GRPO: sum of per-sequence token means / ``num_seqs``),
    ``"seq_mean_token_sum_norm"`` (Dr. GRPO: sum of per-sequence token sums / ``norm_constant`` /
    ``num_seqs``; ``norm_constant`` defaults to ``T``, pass a fixed one such as the maximum number
    of generated tokens when micro-batches differ in width). Summing the results over all
    micro-batches of all ranks, with the global ``num_tokens`` / ``num_seqs``, equals one call on
    the whole batch. Masked-out entries are ignored even when they hold inf or nan.
    """
    fn = get_loss_aggregation(mode, "mode")
    check_2d("token_values", token_values)
    check_same_shape("token_values", token_values, mask=mask)
    for name, value in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        if not isinstance(value, Tensor):
            check_number(name, value, low=0, optional=True, unit=" (the global denominator)")
    if norm_constant is not None and not isinstance(norm_constant, Tensor):
        check_number("norm_constant", norm_constant, low=0, strict=True)
    keep = mask.bool()
    masked = torch.where(keep, token_values, torch.zeros_like(token_values))
    return fn(masked, keep, num_tokens, num_seqs, norm_constant)


def local_counts(mask: Tensor) -> Tensor:
    """``[num masked tokens, num sequences]`` (float64) of a [B, T] ``mask``: sum it over every
    micro-batch of every rank (one all-reduce) to get ``num_tokens`` / ``num_seqs`` for ``aggregate``."""
    check_2d("mask", mask)
    rows = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    # on mask's device, ready for NCCL
    return torch.stack([mask.bool().sum().to(torch.float64), rows])


def _denominator(value: Number | None, local: Tensor) -> Tensor:
    # clamp(min=1): a slice (or batch) without a single generated token contributes 0, not nan.
    d = local if value is None else torch.as_tensor(value, device=local.device)
    return d.to(torch.float64).clamp(min=1)


def _num_rows(masked: Tensor) -> Tensor:
    return torch.tensor(masked.shape[0], device=masked.device)


def _divide(total: Tensor, denominator: Tensor) -> Tensor:
    return total / denominator.to(device=total.device, dtype=total.dtype)


@LOSS_AGGREGATIONS.register("token_mean")
def _token_mean(
    masked: Tensor,
    keep: Tensor,
    num_tokens: Number | None,
    num_seqs: Number | None,
    norm_constant: Number | None,
) -> Tensor:
    return _divide(masked.sum(), _denominator(num_tokens, keep.sum()))


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def _seq_mean_token_mean(
    masked: Tensor,
    keep: Tensor,
    num_tokens: Number | None,
    num_seqs: Number | None,
    norm_constant: Number | None,
) -> Tensor:
    row_lens = keep.sum(dim=1).clamp(min=1).to(masked.dtype)  # [B]
    per_seq = masked.sum(dim=1) / row_lens  # [B]
    return _divide(per_seq.sum(), _denominator(num_seqs, _num_rows(masked)))


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")
def _seq_mean_token_sum_norm(
    masked: Tensor,
    keep: Tensor,
    num_tokens: Number | None,
    num_seqs: Number | None,
    norm_constant: Number | None,
) -> Tensor:
    norm = masked.shape[1] if norm_constant is None else norm_constant
    per_seq = masked.sum(dim=1) / norm  # [B]
    return _divide(per_seq.sum(), _denominator(num_seqs, _num_rows(masked)))

"""Tensor-shape checks shared by the estimators and losses (scalar arguments: ``earl_lightning.core.checks``):
each error names the argument as the caller wrote it, the bad shape, and what is allowed."""

from __future__ import annotations

from torch import Tensor


def check_same_shape(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    """Every tensor in ``others`` (None skipped) must have the shape of ``ref``."""
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(t.shape)}, expected {tuple(ref.shape)} like `{ref_name}`"
            )


def check_2d(name: str, t: Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"`{name}` must be 2-D [B, T], got shape {tuple(t.shape)}")

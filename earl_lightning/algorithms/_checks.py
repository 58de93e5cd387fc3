"""Argument checks shared by the estimators and losses: each error names the argument as the caller
wrote it, the bad value, and what is allowed."""

from __future__ import annotations

import math

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


def check_unit_interval(name: str, value: float) -> None:
    """``value`` must be a real number in [0, 1] (discount factors, GAE lambda)."""
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}")


def check_positive(name: str, value: float) -> None:
    if not _is_real(value) or not value > 0.0:
        raise ValueError(f"`{name}` must be a positive number, got {value!r}")


def check_non_negative(name: str, value: float) -> None:
    if not _is_real(value) or not value >= 0.0:
        raise ValueError(f"`{name}` must be a number >= 0, got {value!r}")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

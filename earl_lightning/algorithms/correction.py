"""Rollout correction: importance weights between the policy that sampled the tokens and the one
the trainer computes, truncated (TIS) or masked (MIS).

A generation engine (vLLM) and the trainer compute slightly different probabilities for the same
weights (kernels, precision, batching), so the rollout's tokens come from ``pi_rollout`` while the
update's ratio ``pi_theta / pi_old`` takes ``pi_old`` from the trainer. The weight
``w = pi_old / pi_rollout`` (from the trainer's old log-probs and the backend's sampled ones) makes
the policy gradient an estimate under the right distribution again. Unbounded it has a huge
variance; two remedies (verl's rollout correction, TRL's ``vllm_importance_sampling_*``):

- **truncate** (TIS, Yao et al., 2025): ``w`` is clipped into ``[low, high]`` (``low`` None: no lower
  bound); every token stays in the loss, weighted.
- **mask** (MIS, Liu et al., 2025): a token whose ``w`` lies outside ``[low, high]`` leaves the loss
  (its denominators too); the others keep their weight.

At level **token** each token has its own ratio; at level **sequence** a row's tokens share the
ratio of the whole row (the product of its tokens' ratios), so masking drops whole rows. Levels and
modes are registered by name (``register_is_level``, ``register_is_mode``), as losses are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from earl_lightning.algorithms._checks import check_2d, check_same_shape
from earl_lightning.core.registry import Registry

# exp() of a log-weight beyond this overflows float32 (as the policy losses' MAX_LOG_RATIO)
MAX_LOG_WEIGHT = 20.0

LevelFn = Callable[[Tensor, Tensor], Tensor]
ModeFn = Callable[[Tensor, "float | None", float], tuple[Tensor, Tensor]]
IS_LEVELS: Registry[LevelFn] = Registry("importance-weight levels")
IS_MODES: Registry[ModeFn] = Registry("importance-weight modes")


def register_is_level(name: str) -> Callable[[LevelFn], LevelFn]:
    """Decorator: ``fn(log_ratio [B, T], mask [B, T]) -> log-weights [B, T]`` as level ``name``."""
    return IS_LEVELS.register(name)


def register_is_mode(name: str) -> Callable[[ModeFn], ModeFn]:
    """Decorator: ``fn(weights [B, T], low, high) -> (weights [B, T], keep [B, T] bool)`` as mode ``name``."""
    return IS_MODES.register(name)


def get_is_level(name: str, arg: str = "level") -> LevelFn:
    """The level registered as ``name``; an unknown name lists the valid ones."""
    return IS_LEVELS.get(name, arg)


def get_is_mode(name: str, arg: str = "mode") -> ModeFn:
    """The mode registered as ``name``; an unknown name lists the valid ones."""
    return IS_MODES.get(name, arg)


@register_is_level("token")
def token_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[B, T] -> [B, T]: each token's own log-ratio."""
    return log_ratio


@register_is_level("sequence")
def sequence_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[B, T] -> [B, T]: the sum of a row's masked log-ratios (the log-ratio of the whole row's
    probability) on every token of the row."""
    return (log_ratio * mask).sum(-1, keepdim=True).expand_as(log_ratio)  # [B, 1] -> [B, T]


@register_is_mode("truncate")
def truncate_weights(weights: Tensor, low: float | None, high: float) -> tuple[Tensor, Tensor]:
    """TIS: ``weights`` [B, T] clipped to at most ``high`` (and at least ``low`` when given); every
    token is kept."""
    return weights.clamp(min=low, max=high), torch.ones_like(weights, dtype=torch.bool)


@register_is_mode("mask")
def mask_weights(weights: Tensor, low: float | None, high: float) -> tuple[Tensor, Tensor]:
    """MIS: a token whose weight [B, T] is above ``high`` (or below ``low`` when given) is dropped
    (keep False, weight 0); the others keep their weight."""
    keep = weights <= high
    if low is not None:
        keep &= weights >= low
    return torch.where(keep, weights, torch.zeros_like(weights)), keep


class Corrected(NamedTuple):
    """What :meth:`RolloutCorrection.weights` gives, each [B, T]: the weights the policy loss is
    multiplied by (0 off ``keep``), which tokens stay in the loss (within ``mask``), and the
    weights before the bounds (1 outside ``mask``: for the statistics)."""

    weights: Tensor
    keep: Tensor
    raw: Tensor


@dataclass(frozen=True)
class RolloutCorrection:
    """A level, a mode and the bounds ``[low, high]`` (``low`` None: no lower bound)."""

    level: LevelFn
    mode: ModeFn
    low: float | None
    high: float

    def weights(self, old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Corrected:
        """The importance weights ``pi_old / pi_rollout`` of the masked tokens.

        ``old_logprobs`` (the trainer's, at the weights the rollout sampled with),
        ``rollout_logprobs`` (the backend's sampled ones) and ``mask`` (1 on generated tokens) are
        [B, T]. Equal log-probs give weights of exactly 1 (``low <= 1 <= high``).
        """
        check_2d("old_logprobs", old_logprobs)
        check_same_shape("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
        on = mask.bool()
        log_ratio = torch.where(on, old_logprobs - rollout_logprobs, 0.0)  # [B, T]
        log_w = self.level(log_ratio, mask.to(log_ratio.dtype)).clamp(
            -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT
        )
        raw = torch.where(on, torch.exp(log_w), 1.0)  # [B, T]
        weights, keep = self.mode(raw, self.low, self.high)
        keep = keep & on
        return Corrected(torch.where(keep, weights, 0.0), keep, raw)

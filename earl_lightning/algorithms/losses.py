"""Per-token policy losses (PPO clip, GSPO) and the clipped value loss.

Every loss returns per-token values [B, T] (0 where ``mask`` is 0) plus detached statistics over the
masked tokens; turning them into a scalar is :func:`aggregation.aggregate`'s job, so one loss works
with every aggregation mode and with micro-batching.

The policy-loss contract (what ``algorithm.loss.name`` selects): ``fn(logprobs, old_logprobs,
advantages, mask, **params) -> (per-token losses [B, T], stats)``, where ``stats`` is a
:class:`PolicyLossStats` or a mapping of name -> scalar tensor, each a mean over the masked tokens
(logged as ``policy/<name>``). Register one with ``@register_policy_loss("name")``, or name an
unregistered function by import path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from earl_lightning.algorithms._checks import check_2d, check_same_shape
from earl_lightning.core.checks import check_number
from earl_lightning.core.registry import Registry

# exp() of a log-ratio beyond this overflows float32 into inf, and -inf * 0 advantages gives nan.
MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLossStats:
    """Detached scalars over the masked tokens."""

    clip_frac: Tensor  # fraction of tokens whose clipped surrogate is the active one
    dual_clip_frac: Tensor  # fraction of tokens held by the dual-clip bound
    approx_kl: Tensor  # mean of Schulman's k3 estimate of KL(old || new): (ratio - 1) - log ratio
    ratio_mean: Tensor
    ratio_max: Tensor

    def as_dict(self, prefix: str = "policy/") -> dict[str, Tensor]:
        """Every statistic under its logged name (``policy/clip_frac``, ...)."""
        return {prefix + k: v for k, v in asdict(self).items()}

    def token_means(self) -> dict[str, Tensor]:
        """The statistics that are means over the masked tokens (``ratio_max`` is not)."""
        return {
            "clip_frac": self.clip_frac,
            "dual_clip_frac": self.dual_clip_frac,
            "approx_kl": self.approx_kl,
            "ratio_mean": self.ratio_mean,
        }


PolicyLossFn = Callable[..., tuple[Tensor, "PolicyLossStats | Mapping[str, Tensor]"]]


def _adapt(obj: object, arg: str) -> PolicyLossFn:
    if not callable(obj):
        raise ValueError(
            f"`{arg}` names {obj!r}, which is not a function; a policy loss is "
            f"`fn(logprobs, old_logprobs, advantages, mask, **params) -> (losses, stats)`"
        )
    return obj


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy losses", adapt=_adapt)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss (the contract is in the module docstring) as ``name``.

    Args:
        name: the name a config selects it by (``--model.algorithm.loss.name name``).

    Returns:
        The decorator; it returns the decorated function unchanged, so it stays callable directly.

    Raises:
        ValueError: when the decorator is applied and ``name`` is already registered (two modules
            cannot silently shadow each other's loss).
    """
    return POLICY_LOSSES.register(name)


def loss_stat_means(stats: PolicyLossStats | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A loss's statistics as token means (the contract allows either form)."""
    return stats.token_means() if isinstance(stats, PolicyLossStats) else dict(stats)


def get_policy_loss(name: str, arg: str = "policy_loss") -> PolicyLossFn:
    """The policy loss registered as ``name``; an unknown name lists the valid ones."""
    return POLICY_LOSSES.get(name, arg)


def check_clip_args(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    """Config-time check of the PPO clip bounds; the ratio is clipped to [1-clip_low, 1+clip_high]."""
    check_number("clip_high", clip_high, low=0)
    why = " (the ratio's lower bound is 1 - clip_low)"
    check_number("clip_low", clip_low, low=0, high=1, strict_high=True, unit=why)
    check_number("dual_clip", dual_clip, low=1, strict=True, optional=True)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO's clipped surrogate with token-level ratios ``exp(logprobs - old_logprobs)``.

    ``logprobs``, ``old_logprobs``, ``mask`` [B, T]; ``advantages`` [B, T] or [B] (one per sequence).
    Per token: ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c``
    the loss of a negative-advantage token is further capped at ``-A * c`` (Ye et al., 2020), so a
    huge ratio on a bad token cannot blow up the update. Returns ([B, T] losses, stats).
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask)
    log_ratio = logprobs - old_logprobs.detach()
    return _clipped_surrogate(
        log_ratio, log_ratio, advantages, mask, clip_low, clip_high, dual_clip
    )


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """GSPO (Zheng et al., 2025): PPO clip on the sequence-level ratio.

    The ratio of every token of a sequence is ``exp(mean of its masked token log-ratios)``, so the
    clip acts on whole sequences (the paper's bounds are ~1e-4, hence the defaults). Same shapes
    and return as :func:`ppo_clip_loss`.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask)
    keep = mask.bool()
    token_lr = torch.where(keep, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    seq_lr = token_lr.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    return _clipped_surrogate(
        seq_lr.expand_as(logprobs), token_lr, advantages, mask, clip_low, clip_high, dual_clip
    )


def _check_policy_inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> None:
    check_2d("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, mask=mask)
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(
            f"`advantages` has shape {tuple(advantages.shape)}, expected {tuple(logprobs.shape)} (per token) "
            f"or ({logprobs.shape[0]},) (per sequence)"
        )


def _clipped_surrogate(
    log_ratio: Tensor,
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, PolicyLossStats]:
    """The clip math shared by token- and sequence-level ratios; ``token_log_ratio`` feeds the KL stat."""
    check_clip_args(clip_low, clip_high, dual_clip)
    adv = advantages.detach()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] broadcasts over tokens
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_held = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_held = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    keep = mask.bool()
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    return loss, _policy_stats(ratio, token_log_ratio, clipped > unclipped, dual_held, keep)


def _policy_stats(
    ratio: Tensor, token_log_ratio: Tensor, clipped: Tensor, dual_held: Tensor, keep: Tensor
) -> PolicyLossStats:
    with torch.no_grad():
        n = keep.sum().clamp(min=1)
        lr = token_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = torch.expm1(lr) - lr
        ratio_max = (
            ratio.masked_fill(~keep, float("-inf")).max() if keep.any() else ratio.new_zeros(())
        )
        return PolicyLossStats(
            clip_frac=(clipped & keep).sum() / n,
            dual_clip_frac=(dual_held & keep).sum() / n,
            approx_kl=torch.where(keep, k3, 0.0).sum() / n,
            ratio_mean=torch.where(keep, ratio, 0.0).sum() / n,
            ratio_max=ratio_max,
        )


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float | None = 0.2,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss -> ([B, T] per-token losses, clip fraction over masked tokens).

    ``0.5 * max((v - R)^2, (old_v + clip(v - old_v, -c, c) - R)^2)`` with ``c = value_clip``; None
    turns clipping off (plain squared error). All inputs [B, T]; aggregate with ``aggregate``.
    """
    check_2d("values", values)
    check_same_shape("values", values, old_values=old_values, returns=returns, mask=mask)
    if value_clip is not None:
        check_number("value_clip", value_clip, low=0)
    target, old = returns.detach(), old_values.detach()
    unclipped = (values - target) ** 2
    if value_clip is None:
        loss, clipped_active = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped = (old + (values - old).clamp(-value_clip, value_clip) - target) ** 2
        loss, clipped_active = torch.maximum(unclipped, clipped), clipped > unclipped
    keep = mask.bool()
    clip_frac = (clipped_active & keep).sum().detach() / keep.sum().clamp(min=1)
    return torch.where(keep, 0.5 * loss, torch.zeros_like(loss)), clip_frac

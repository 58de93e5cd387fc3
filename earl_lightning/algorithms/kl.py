"""KL estimators between the policy and a reference policy, from the log-probs of sampled tokens.

With ``d = ref_logprobs - logprobs`` on tokens sampled from the policy (Schulman, "Approximating KL
divergence", 2020): ``k1 = -d`` (unbiased, high variance, can be negative), ``k2 = d^2 / 2`` (biased,
low variance), ``k3 = exp(d) - d - 1`` (unbiased and always >= 0). Each is usable as a loss term
(aggregate it like a policy loss) or as a per-token penalty subtracted from the rewards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from earl_lightning.algorithms._checks import check_2d, check_same_shape
from earl_lightning.core.checks import check_number
from earl_lightning.core.registry import Registry

KlFn = Callable[[Tensor, Tensor], Tensor]
KlEstimatorName = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: Registry[KlFn] = Registry("KL estimators")
# exp(d) for |d| > 20 overflows float32 into inf, one token with a tiny reference probability would
# dominate the batch: clamp d, then the estimate, as verl's "low_var_kl" does.
K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def get_kl_estimator(name: str, arg: str = "kl_estimator") -> KlFn:
    """The estimator registered as ``name``; an unknown name lists the valid ones."""
    return KL_ESTIMATORS.get(name, arg)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``log p - log p_ref`` per token, any shape."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``(log p - log p_ref)^2 / 2`` per token, any shape."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``exp(d) - d - 1`` with ``d = log p_ref - log p`` clamped to +-20, result clamped to <= 10."""
    d = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.expm1(d) - d).clamp(max=K3_CLAMP)


def kl_divergence(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KlEstimatorName = "k3"
) -> Tensor:
    """Per-token KL estimate [B, T], 0 where ``mask`` is 0. Differentiable in ``logprobs`` (loss use)."""
    fn = get_kl_estimator(estimator, "estimator")
    check_2d("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs, mask=mask)
    kl = fn(logprobs, ref_logprobs.detach())
    return torch.where(mask.bool(), kl, torch.zeros_like(kl))


def kl_penalized_rewards(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    coef: float,
    estimator: KlEstimatorName = "k1",
) -> Tensor:
    """``token_rewards - coef * KL`` on generated tokens, [B, T] (the REINFORCE++ / PPO reward shaping).

    The KL is detached: as a reward it shapes the return, it is not a gradient path.
    """
    check_number("coef", coef, low=0)
    check_same_shape("token_rewards", token_rewards, logprobs=logprobs)
    kl = kl_divergence(logprobs.detach(), ref_logprobs, mask, estimator)
    return token_rewards - coef * kl.to(token_rewards.dtype)

"""A user's own policy loss and advantage estimator, as a recipe names them by import path.

``centered_reinforce_loss`` is registered (``algorithm.loss.name: centered_reinforce`` once this
module is imported, or by its import path); ``whole_batch_baseline`` is not registered, and its
import path alone selects it. Both are real, if simple, algorithms.
"""

from __future__ import annotations

import torch

from earl_lightning.algorithms import AdvantageOutput, register_policy_loss
from earl_lightning.algorithms.moments import moments

NOT_A_FUNCTION = 3


@register_policy_loss("centered_reinforce")
def centered_reinforce_loss(logprobs, old_logprobs, advantages, mask, *, scale: float = 1.0):
    """REINFORCE with importance weights: ``-scale * A * exp(logp - old)`` per token (no clip)."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    loss = torch.where(mask.bool(), -scale * adv.detach() * ratio, torch.zeros_like(ratio))
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        stats = {"ratio_mean": torch.where(mask.bool(), ratio, 0.0).sum() / n}
    return loss, stats


def whole_batch_baseline(inputs, reduce):
    """Each episode's reward minus the mean reward of the whole batch (over every rank)."""
    first = inputs.episode_rows
    (whole,) = reduce([moments(inputs.rewards[first])])
    adv = inputs.rewards - whole.mean().to(inputs.rewards.dtype)
    return AdvantageOutput(adv[:, None] * inputs.mask)

"""Advantage estimators behind one contract, registered by name.

An estimator is a function ``fn(inputs: AdvantageInputs, reduce: MomentsReduce, **params) ->
AdvantageOutput``. ``reduce`` sums :class:`Moments` over every rank that holds part of the batch
(the identity in one process), so an estimator that normalizes over a group or the batch gets the
single-process answer without ever moving a reward. Register one with::

    @register_advantage_estimator("my_adv", needs_values=False)
    def my_adv(inputs, reduce, *, my_param: float = 1.0) -> AdvantageOutput: ...

and select it with ``algorithm.advantage.name: my_adv`` (after importing its module) or by import
path ``my_package.module.my_adv``. ``needs_values`` asks the trainer for a value head and
``inputs.values``. Keyword parameters come from the config (``algorithm.advantage.gamma``, ...,
and ``kwargs``); a parameter the estimator does not take is a config-time error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from earl_lightning.algorithms.advantages import (
    GrpoScale,
    anchor_state_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from earl_lightning.algorithms.moments import Moments, grouped_moments, moments
from earl_lightning.core.registry import Registry

MomentsReduce = Callable[[Sequence[Moments]], Sequence[Moments]]


def local_moments(parts: Sequence[Moments]) -> Sequence[Moments]:
    """The one-process ``reduce``: the local batch is the whole batch."""
    return parts


@dataclass
class AdvantageInputs:
    """The padded batch an estimator sees: ``B`` rows of width ``T``.

    ``episode_rows`` [B] bool marks the rows that stand for their episode in per-episode
    statistics (an episode trained as one row per turn has several rows and one reward).
    ``token_rewards`` [B, T] hold each turn's reward on its last generated token, minus the KL
    penalty when it is part of the reward. ``values`` [B, T] only for estimators that need them.
    ``state_keys`` [B] int64 only for estimators that need them (``needs_state_keys``): equal for
    the turn rows of one group whose prompts are equal; then each group's rows are on this rank.
    """

    rewards: Tensor  # [B] the episode's reward, per row
    group_ids: Tensor  # [B] int64 in [0, num_groups)
    num_groups: int
    episode_rows: Tensor  # [B] bool
    token_rewards: Tensor  # [B, T]
    mask: Tensor  # [B, T] 1 on generated tokens
    values: Tensor | None = None  # [B, T]
    state_keys: Tensor | None = None  # [B]


@dataclass
class AdvantageOutput:
    """What an estimator returns: per-token advantages, and the value head's targets when the
    estimator has a value baseline (None otherwise: the trainer then trains no value head)."""

    advantages: Tensor  # [B, T], 0 off the mask
    returns: Tensor | None = None  # [B, T] value targets (estimators with a value baseline)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function and what it needs from the trainer."""

    fn: Callable[..., AdvantageOutput]
    needs_values: bool = False
    needs_state_keys: bool = False  # turn rows (history_turns set), each group's rows on one rank

    def __call__(
        self, inputs: AdvantageInputs, reduce: MomentsReduce = local_moments, **params: Any
    ) -> AdvantageOutput:
        """Run the estimator on ``inputs``; ``reduce`` sums moments over the ranks holding the
        batch (the default, in one process: the local batch is the whole batch)."""
        return self.fn(inputs, reduce, **params)


def _adapt(obj: Any, arg: str) -> AdvantageEstimator:
    """An unregistered function named by import path: an estimator that needs no values."""
    if isinstance(obj, AdvantageEstimator):
        return obj
    if not callable(obj):
        raise ValueError(
            f"`{arg}` names {obj!r}, which is not a function; an advantage estimator is "
            f"`fn(inputs, reduce, **params) -> AdvantageOutput`"
        )
    return AdvantageEstimator(obj)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimators", adapt=_adapt)


def register_advantage_estimator(
    name: str, *, needs_values: bool = False, needs_state_keys: bool = False
) -> Callable[[Any], Any]:
    """Decorator registering ``fn(inputs, reduce, **params) -> AdvantageOutput`` as ``name``.

    Args:
        name: the name a config selects it by (``--model.algorithm.advantage.name name``).
        needs_values: the estimator reads ``inputs.values``: the trainer builds a value head and
            trains it on the returned ``returns``.
        needs_state_keys: the estimator compares turn rows that acted in the same state (GiGPO):
            the trainer fills ``inputs.state_keys`` and keeps each group's rows on one rank.

    Returns:
        The decorator; it returns the decorated function unchanged, so it stays callable directly.

    Raises:
        ValueError: when the decorator is applied and ``name`` is already registered (two modules
            cannot silently shadow each other's estimator).
    """
    return ADVANTAGE_ESTIMATORS.register(
        name, entry=lambda fn: AdvantageEstimator(fn, needs_values, needs_state_keys)
    )


def get_advantage_estimator(name: str, arg: str = "advantage_estimator") -> AdvantageEstimator:
    """The estimator registered as ``name`` (or at that import path); an unknown name lists the valid ones."""
    return ADVANTAGE_ESTIMATORS.get(name, arg)


def _per_row(adv: Tensor, mask: Tensor) -> Tensor:
    return adv[:, None].to(mask.dtype) * mask  # [B] -> [B, T] on the generated tokens


@register_advantage_estimator("grpo")
def grpo(
    inputs: AdvantageInputs, reduce: MomentsReduce, *, scale: GrpoScale = "group", eps: float = 1e-6
) -> AdvantageOutput:
    """GRPO: each episode's reward normalized within its group (one reward per episode)."""
    r, g, first = inputs.rewards, inputs.group_ids, inputs.episode_rows
    group, whole = reduce(
        [grouped_moments(r[first], g[first], inputs.num_groups), moments(r[first])]
    )
    adv = grpo_advantages(
        r, g, num_groups=inputs.num_groups, scale=scale, eps=eps, group=group, batch=whole
    )
    return AdvantageOutput(_per_row(adv, inputs.mask))


@register_advantage_estimator("gigpo", needs_state_keys=True)
def gigpo(
    inputs: AdvantageInputs,
    reduce: MomentsReduce,
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    scale: GrpoScale = "group",
    eps: float = 1e-6,
) -> AdvantageOutput:
    """GiGPO (Feng et al., 2025): GRPO's episode advantage plus ``step_weight`` times a step-level
    advantage that compares the turns of a group taken in the same state by their discounted
    returns (``gamma``, applied where the turn rows are built), so a turn that differs from its
    group-mates in that state gets the credit or the blame. Needs one row per turn."""
    if inputs.state_keys is None:
        raise ValueError(
            "the 'gigpo' estimator needs one row per turn (`rollout.history_turns` set) and the "
            "rows' state keys; this batch has none"
        )
    episode = grpo(inputs, reduce, scale=scale, eps=eps).advantages  # [B, T]
    valid = inputs.mask.sum(dim=1) > 0
    # a turn row's return sits on its last token
    returns = (inputs.token_rewards * inputs.mask).sum(dim=1)
    step = anchor_state_advantages(returns, inputs.state_keys, valid, scale=scale, eps=eps)
    return AdvantageOutput(episode + _per_row(step_weight * step, inputs.mask))


@register_advantage_estimator("rloo")
def rloo(inputs: AdvantageInputs, reduce: MomentsReduce) -> AdvantageOutput:
    """RLOO: each episode's reward minus the mean of the other rewards of its group."""
    r, g, first = inputs.rewards, inputs.group_ids, inputs.episode_rows
    (group,) = reduce([grouped_moments(r[first], g[first], inputs.num_groups)])
    adv = rloo_advantages(r, g, num_groups=inputs.num_groups, group=group)
    return AdvantageOutput(_per_row(adv, inputs.mask))


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(
    inputs: AdvantageInputs, reduce: MomentsReduce, *, gamma: float = 1.0, eps: float = 1e-8
) -> AdvantageOutput:
    """REINFORCE++: discounted returns-to-go whitened over every generated token of the batch."""
    returns = discounted_returns(inputs.token_rewards, inputs.mask, gamma=gamma)
    (whole,) = reduce([moments(returns, inputs.mask)])
    adv = reinforce_pp_advantages(
        inputs.token_rewards, inputs.mask, gamma=gamma, eps=eps, batch=whole
    )
    return AdvantageOutput(adv)


@register_advantage_estimator("gae", needs_values=True)
def gae(
    inputs: AdvantageInputs, reduce: MomentsReduce, *, gamma: float = 1.0, lam: float = 1.0
) -> AdvantageOutput:
    """GAE over the generated tokens with the value head's estimates (PPO's actor-critic)."""
    if inputs.values is None:
        raise ValueError("the 'gae' estimator needs `values` (a value head); none were computed")
    adv, ret = gae_advantages(
        inputs.token_rewards, inputs.values, inputs.mask, gamma=gamma, lam=lam
    )
    return AdvantageOutput(adv, ret)

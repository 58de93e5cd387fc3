"""The algorithm group's settings: the policy loss, the KL to the reference, the value head's
loss, and what peers add to the plain update: the rollout correction
(truncated or masked importance sampling), DAPO's soft overlong punishment and its dynamic sampling.
Each is a frozen dataclass checked on construction, errors naming the flag as written
(``--model.algorithm.rollout_correction.high``); :class:`~earl_lightning.modules.config.AlgorithmConfig`
holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from earl_lightning.algorithms import get_kl_estimator, get_loss_aggregation, get_policy_loss
from earl_lightning.algorithms.correction import RolloutCorrection, get_is_level, get_is_mode
from earl_lightning.algorithms.shaping import overlong_penalty
from earl_lightning.core.checks import check_count, check_number
from earl_lightning.core.registry import bind_params

ARG = "--model.algorithm"


@dataclass(frozen=True)
class LossConfig:
    """The policy loss and how per-token losses become one scalar.

    Args:
        name: registered name (``ppo_clip``, ``gspo``) or import path of a function registered
            with ``register_policy_loss``.
        clip_low: the ratio is clipped below at ``1 - clip_low``; null: the loss's default.
        clip_high: the ratio is clipped above at ``1 + clip_high``; null: the loss's default.
        dual_clip: cap of a negative-advantage token's loss at ``-A * dual_clip`` (> 1; null: off).
        aggregation: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO) or
            ``seq_mean_token_sum_norm`` (Dr. GRPO); also applied to the entropy and KL terms.
        norm_constant: the constant of ``seq_mean_token_sum_norm`` (null: ``max_context_tokens``).
        kwargs: further keyword parameters of a user's loss.
    """

    name: str = "ppo_clip"
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    norm_constant: float | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arg = f"{ARG}.loss"
        why = " (the ratio's lower bound is 1 - clip_low)"
        below_one = dict(low=0, high=1, strict_high=True, optional=True)
        check_number(f"{arg}.clip_low", self.clip_low, **below_one, unit=why)
        check_number(f"{arg}.clip_high", self.clip_high, low=0, optional=True)
        check_number(f"{arg}.dual_clip", self.dual_clip, low=1.0, strict=True, optional=True)
        check_number(f"{arg}.norm_constant", self.norm_constant, low=0, strict=True, optional=True)
        get_loss_aggregation(self.aggregation, f"{arg}.aggregation")
        self.params  # noqa: B018 - resolves the loss and binds its parameters now, at config time

    @property
    def fn(self):
        """The policy loss function that ``name`` selects (a registered name or an import path)."""
        return get_policy_loss(self.name, f"{ARG}.loss.name")

    @property
    def params(self) -> dict[str, Any]:
        """The keyword parameters the loss is called with: the clip settings that are set and
        ``kwargs``, checked against its signature (a setting it does not take is an error)."""
        given = {
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "dual_clip": self.dual_clip,
            **self.kwargs,
        }
        return bind_params(
            self.fn, given, what=f"policy loss {self.name!r}", arg=f"{ARG}.loss", skip=4
        )


@dataclass(frozen=True)
class KLConfig:
    """KL to a frozen reference model (a copy of the starting weights).

    Args:
        coef: weight of the KL (0 disables it and the reference model).
        estimator: ``k1``, ``k2`` or ``k3`` (Schulman's estimators), or an import path.
        in_reward: subtract the KL from the token rewards instead of adding it to the loss.
    """

    coef: float = 0.0
    estimator: str = "k3"
    in_reward: bool = False

    def __post_init__(self) -> None:
        check_number(f"{ARG}.kl.coef", self.coef, low=0)
        get_kl_estimator(self.estimator, f"{ARG}.kl.estimator")


@dataclass(frozen=True)
class ValueConfig:
    """The value head's loss (used when the estimator needs values, e.g. ``gae``).

    Args:
        coef: weight of the value loss ``0.5 * (V - G)^2``.
        clip: PPO value clipping around the old values (null: plain squared error).
    """

    coef: float = 0.5
    clip: float | None = 0.2

    def __post_init__(self) -> None:
        check_number(f"{ARG}.value.coef", self.coef, low=0)
        check_number(f"{ARG}.value.clip", self.clip, low=0, optional=True)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights ``pi_old / pi_rollout`` between the trainer's log-probs and the ones the
    backend sampled with (verl's rollout correction, TRL's ``vllm_importance_sampling_correction``).

    Args:
        level: null (default): no correction. ``token``: each generated token its own weight;
            ``sequence``: a row's tokens share the weight of the whole row (the product of its
            tokens' ratios); or the import path of a level registered with ``register_is_level``.
            On, the old log-probs are always computed (the on-policy shortcut is off).
        mode: ``truncate`` (TIS): a weight is clipped into ``[low, high]`` and every token stays;
            ``mask`` (MIS): a token (at level ``sequence``, a row) whose weight lies outside
            ``[low, high]`` leaves the loss and its denominators, the others keep their weight;
            or an import path registered with ``register_is_mode``.
        low: the lower bound (<= 1); null: none (TRL's).
        high: the upper bound (>= 1; TRL's ``vllm_importance_sampling_cap`` is 3 in recent versions, verl's
            threshold 2).
    """

    level: str | None = None
    mode: str = "truncate"
    low: float | None = None
    high: float = 2.0

    _arg = f"{ARG}.rollout_correction"

    def __post_init__(self) -> None:
        if self.level is not None:
            get_is_level(self.level, f"{self._arg}.level")
        get_is_mode(self.mode, f"{self._arg}.mode")
        # equal log-probs must keep a weight of exactly 1: 1 lies within the bounds
        check_number(f"{self._arg}.high", self.high, low=1)
        check_number(f"{self._arg}.low", self.low, low=0, high=1, optional=True)

    @property
    def spec(self) -> RolloutCorrection | None:
        """What the update applies (None: off)."""
        if self.level is None:
            return None
        return RolloutCorrection(
            get_is_level(self.level, f"{self._arg}.level"),
            get_is_mode(self.mode, f"{self._arg}.mode"),
            self.low,
            self.high,
        )


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO's soft overlong punishment: an episode that generated close to ``max_tokens`` tokens
    loses reward, linearly over the last ``buffer`` tokens (training only; the evaluation is scored
    as the task scores it).

    Args:
        max_tokens: the generated tokens (all of an episode's turns) at which the whole
            ``penalty`` applies (DAPO's L_max: set it to ``rollout.sampling.max_new_tokens`` for a
            one-turn task); null (default): off.
        buffer: the tokens before ``max_tokens`` over which the penalty grows from 0 (DAPO's
            L_cache); null: a fifth of ``max_tokens`` (DAPO's 4,096 of 20,480).
        penalty: the reward lost at ``max_tokens`` (and beyond).
    """

    max_tokens: int | None = None
    buffer: int | None = None
    penalty: float = 1.0

    _arg = f"{ARG}.overlong"

    def __post_init__(self) -> None:
        check_count(f"{self._arg}.max_tokens", self.max_tokens, optional=True)
        check_count(f"{self._arg}.buffer", self.buffer, optional=True)
        check_number(f"{self._arg}.penalty", self.penalty, low=0)
        if self.buffer is not None and self.max_tokens is None:
            raise ValueError(
                f"`{self._arg}.buffer` ({self.buffer}) is set and `{self._arg}.max_tokens` is null: "
                "the buffer is counted back from max_tokens; set max_tokens (or drop the buffer)"
            )
        if self.buffer is not None and self.buffer > self.max_tokens:
            raise ValueError(
                f"`{self._arg}.buffer` ({self.buffer}) must be at most `{self._arg}.max_tokens` "
                f"({self.max_tokens})"
            )

    @property
    def on(self) -> bool:
        """Whether overlong episodes are penalized (``max_tokens`` is set)."""
        return self.max_tokens is not None

    def penalties(self, episodes: Sequence[Any]) -> torch.Tensor:
        """[E] float64: each episode's penalty, by the tokens it generated (all its turns)."""
        lengths = torch.tensor([float(ep.num_generated) for ep in episodes], dtype=torch.float64)
        buffer = self.buffer or max(1, self.max_tokens // 5)
        return overlong_penalty(
            lengths, max_tokens=self.max_tokens, buffer=buffer, penalty=self.penalty
        )

    def apply(self, episodes: Sequence[Any]) -> None:
        """Add each episode's penalty to its reward and its last turn's, as a reward function's
        value is added (a failed episode keeps its 0)."""
        if not self.on or not episodes:
            return
        for ep, p in zip(episodes, self.penalties(episodes).tolist()):
            if ep.error is None and p:
                ep.reward += p
                if ep.turn_rewards:
                    ep.turn_rewards[-1] += p

    def metrics(self, episodes: Sequence[Any], reduce: Any) -> dict[str, float]:
        """``reward/overlong_penalty``: the mean penalty of ``episodes`` that did not fail (every
        rank's, TP peers once); nothing when off. Every rank calls it (a collective)."""
        if not self.on:
            return {}
        shaped = [ep for ep in episodes if ep.error is None]
        total = float(self.penalties(shaped).sum()) if shaped else 0.0
        s, n = reduce.sum_floats([total, float(len(shaped))])
        return {"reward/overlong_penalty": s / n if n else 0.0}


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal under GRPO
    or RLOO) are dropped and more groups drawn until the batch is full.

    Args:
        max_draws: draws of the step's groups at most, the first included. 1 (default): off, the
            groups train as drawn. ``k > 1``: a draw's zero-spread groups are dropped and another
            draw of ``batch_size / group_size`` groups (rows and seeds of their own, keyed by the
            step and the draw, so a resumed run draws the same) is played, until the batch holds
            that many groups with spread; at the ``k``-th draw the batch is filled up with the
            zero-spread groups drawn first.
    """

    max_draws: int = 1

    def __post_init__(self) -> None:
        check_count(f"{ARG}.dynamic_sampling.max_draws", self.max_draws)

    @property
    def on(self) -> bool:
        """Whether zero-spread groups are dropped and drawn again (``max_draws`` above 1)."""
        return self.max_draws > 1


def check_draws(cfg: DynamicSamplingConfig, group_size: int) -> None:
    """Dynamic sampling drops groups without spread: a group of one episode never has any."""
    if cfg.on and group_size < 2:
        raise ValueError(
            f"`{ARG}.dynamic_sampling.max_draws` {cfg.max_draws} drops the groups whose rewards "
            f"are all equal, and with `--data.group_size` {group_size} every group is one episode "
            "(never any spread): use groups of 2 or more, or max_draws 1"
        )

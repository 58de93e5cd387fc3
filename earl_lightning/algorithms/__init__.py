"""Pure RL math: advantages, policy/value losses, aggregation, KL estimators, log-probs, the
rollout correction's importance weights, length shaping, and the pass@k estimator.

Tensors in, tensors out; no torch.distributed, Lightning or logging. Variants are registered by
name; the ``get_*`` lookups raise a ValueError listing the valid names, for config-time checks.
"""

from earl_lightning.algorithms.advantages import (
    GRPO_SCALES,
    anchor_state_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from earl_lightning.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    aggregate,
    get_loss_aggregation,
    local_counts,
)
from earl_lightning.algorithms.correction import (
    IS_LEVELS,
    IS_MODES,
    RolloutCorrection,
    register_is_level,
    register_is_mode,
)
from earl_lightning.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageOutput,
    get_advantage_estimator,
    register_advantage_estimator,
)
from earl_lightning.algorithms.kl import (
    KL_ESTIMATORS,
    get_kl_estimator,
    kl_divergence,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
)
from earl_lightning.algorithms.logprobs import (
    entropy,
    entropy_bonus,
    logprobs_from_logits,
    shifted_entropy,
    shifted_logprobs,
)
from earl_lightning.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossStats,
    check_clip_args,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
    register_policy_loss,
    value_loss,
)
from earl_lightning.algorithms.moments import Moments, grouped_moments, moments
from earl_lightning.algorithms.pass_at_k import pass_at_k
from earl_lightning.algorithms.shaping import overlong_penalty
from earl_lightning.core.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GRPO_SCALES",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageOutput",
    "Moments",
    "PolicyLossStats",
    "Registry",
    "RolloutCorrection",
    "aggregate",
    "anchor_state_advantages",
    "check_clip_args",
    "discounted_returns",
    "entropy",
    "entropy_bonus",
    "gae_advantages",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_aggregation",
    "get_policy_loss",
    "grouped_moments",
    "grpo_advantages",
    "gspo_loss",
    "kl_divergence",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalized_rewards",
    "local_counts",
    "logprobs_from_logits",
    "moments",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "pass_at_k",
    "ppo_clip_loss",
    "register_advantage_estimator",
    "register_is_level",
    "register_is_mode",
    "register_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "shifted_entropy",
    "shifted_logprobs",
    "value_loss",
    "whiten",
]

"""What the stages take, made from the typed configuration groups in one place.

A setting is defined once, in its group (:mod:`earl_lightning.modules.config`), with its default
and its check. The update and the generation backends do not read the groups (they sit below
them and serve Python users who call them directly): they take flat views, and these functions
are the only place that makes them. The views have no defaults of their own, so a default can
not drift from the group's. Also here: what the groups decide together (whether the update is
exactly on-policy) and the module's arguments as plain data (its saved hyperparameters).
"""

from __future__ import annotations

from typing import Any

from earl_lightning.core.config_groups import to_dict
from earl_lightning.modules.config import AlgorithmConfig, OptimConfig, RolloutConfig
from earl_lightning.parallel.memory import Workload, memory_backend
from earl_lightning.rollout.backends.base import BackendSpec
from earl_lightning.train.update import UpdateConfig


def update_view(
    rollout: RolloutConfig | None = None,
    algorithm: AlgorithmConfig | None = None,
    optim: OptimConfig | None = None,
    *,
    micro_batch_tokens: int | None = None,
    allowed_token_ids: list[int] | None = None,
) -> UpdateConfig:
    """The update's settings (None: the group's defaults). ``micro_batch_tokens`` is the stage's
    budget when the layout sets one (else ``optim.micro_batch_tokens``); ``allowed_token_ids`` are
    ``rollout.sampling.allowed_tokens`` as the tokenizer's ids."""
    rollout = rollout if rollout is not None else RolloutConfig()
    algorithm = algorithm if algorithm is not None else AlgorithmConfig()
    optim = optim if optim is not None else OptimConfig()
    loss, kl = algorithm.loss, algorithm.kl
    return UpdateConfig(
        ppo_epochs=optim.ppo_epochs,
        mini_batches=optim.mini_batches,
        micro_batch_tokens=micro_batch_tokens or optim.micro_batch_tokens,
        temperature=rollout.sampling.temperature,
        loss_fn=loss.fn,
        loss_params=loss.params,
        aggregation=loss.aggregation,
        norm_constant=loss.norm_constant or float(rollout.max_context_tokens),
        # a KL in the reward is in the advantages already
        kl_coef=0.0 if kl.in_reward else kl.coef,
        kl_estimator=kl.estimator,
        entropy_coef=algorithm.entropy_coef,
        value_coef=algorithm.value.coef,
        value_clip=algorithm.value.clip,
        max_grad_norm=optim.max_grad_norm,
        allowed_token_ids=allowed_token_ids,
        on_policy=exactly_on_policy(rollout, algorithm, optim),
        share_prefix=optim.share_prefix,
        scored_last_layer=optim.scored_last_layer,
        causal_chunks=optim.causal_chunks,
        rms_norm_backward=optim.rms_norm_backward,
        fused_elementwise=optim.fused_elementwise,
        correction=algorithm.rollout_correction.spec,
        mask_truncated=algorithm.mask_truncated,
    )


def backend_spec(
    model_path: str, dtype: str, seed: int, rollout: RolloutConfig, local_rank: int
) -> BackendSpec:
    """A generation backend's settings: the model's resolved path, the module's dtype and seed,
    the rollout group's context limit and HF fast paths, and this process's rank on its node."""
    return BackendSpec(
        model_path=model_path,
        dtype=dtype,
        seed=seed,
        max_context_tokens=rollout.max_context_tokens,
        reuse_kv=rollout.reuse_kv,
        share_prompts=rollout.share_prompts,
        local_rank=local_rank,
    )


def workload_view(
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    optim: OptimConfig,
    *,
    lora: bool,
    scored_last_layer: bool,
) -> Workload:
    """What the layout selector's memory model sizes: the rollout's backend (a user's, as
    :func:`memory_backend` says) and lengths, the micro-batch budget, a reference model when there
    is a KL (none under LoRA: the reference is the model with its adapters off), and the
    scored-last-layer path when the option is on and the model can take it
    (``scored_last_layer``). The one place a run's :class:`Workload` is made: the module's
    ``workload``, ``earl plan``'s recipe and the plan's calibration all come through here."""
    return Workload(
        backend=memory_backend(rollout.backend),
        max_context_tokens=rollout.max_context_tokens,
        max_new_tokens=rollout.sampling.max_new_tokens,
        micro_batch_tokens=optim.micro_batch_tokens,
        reference_model=algorithm.kl.coef > 0 and not lora,
        reuse_kv=rollout.reuse_kv,
        scored_last_layer=optim.scored_last_layer and scored_last_layer,
    )


def exactly_on_policy(
    rollout: RolloutConfig, algorithm: AlgorithmConfig, optim: OptimConfig
) -> bool:
    """Whether the old log-probs may be the training forward's own (``optim.on_policy_shortcut``):
    one optimizer step per batch (the weights the rollout sampled with are the ones the loss sees),
    log-probs that the trainer computes itself (a vLLM engine's may differ by float noise), and
    nothing else needs the experience forward before the update (values, a KL penalty in the reward,
    the rollout correction's weights)."""
    return (
        optim.on_policy_shortcut
        and optim.ppo_epochs == 1
        and optim.mini_batches == 1
        and rollout.backend == "hf"
        and not algorithm.needs_values
        and not (algorithm.kl.coef and algorithm.kl.in_reward)
        and algorithm.rollout_correction.level is None
    )


def module_hparams(
    model: str,
    dtype: str,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    optim: OptimConfig,
    seed: int,
    transcripts: Any,
    logprob_mismatch_warn: float,
    no_signal_steps: int,
) -> dict[str, Any]:
    """The module's arguments as plain data: what checkpoints store and TensorBoard shows, and what
    ``load_from_checkpoint`` hands back to the constructor (which takes dicts for groups)."""
    return {
        "model": model,
        "dtype": dtype,
        "rollout": to_dict(rollout),
        "algorithm": to_dict(algorithm),
        "optim": to_dict(optim),
        "seed": seed,
        "transcripts": to_dict(transcripts),
        "logprob_mismatch_warn": logprob_mismatch_warn,
        "no_signal_steps": no_signal_steps,
    }

"""The policy (and value) update of one RL iteration: epochs x mini-batches x micro-batches.

Loss denominators are global (all micro-batches of all data-parallel ranks of a mini-batch), so
the summed gradient equals the gradient of the whole mini-batch's loss computed at once, whatever
the layout and the micro-batch token budget: this is what makes layouts numerically equivalent.
Everything the update touches comes in as an argument: the models, the optimizer and its
schedule, the batch, the settings, the stage's reducer and the backward function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from earl_lightning.algorithms import aggregate, kl_divergence, value_loss
from earl_lightning.algorithms.correction import RolloutCorrection
from earl_lightning.algorithms.losses import PolicyLossFn, loss_stat_means
from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.parallel.collectives import Reducer, clip_gradients
from earl_lightning.train.forward import forward_micro_batch, zero_loss
from earl_lightning.train.loss_weights import MAXED, SUMMED, add_loss_weights, correction_metrics
from earl_lightning.train.prefix import PrefixPlan, prefix_plan


@dataclass(frozen=True)
class UpdateConfig:
    """The update's settings: a flat view of the typed groups (``--model.optim``,
    ``--model.algorithm``, the rollout's temperature and context), made only by
    :func:`earl_lightning.modules.views.update_view`; no defaults here, so none can drift from the
    groups'."""

    ppo_epochs: int
    mini_batches: int
    micro_batch_tokens: int
    temperature: float
    loss_fn: PolicyLossFn
    loss_params: dict[str, Any]
    aggregation: str
    norm_constant: float
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    value_coef: float
    value_clip: float | None
    max_grad_norm: float
    allowed_token_ids: list[int] | None
    # old log-probs = this forward's, detached (modules.views.exactly_on_policy)
    on_policy: bool
    # a prompt shared by several sequences runs once (train.prefix)
    share_prefix: bool
    # the last layer only where an action token is scored (train.scored)
    scored_last_layer: bool
    # on CPU, causal attention in query chunks where that is faster (train.causal_chunks)
    causal_chunks: bool
    # the RMSNorms' backward written out (train.rms_norm)
    rms_norm_backward: bool
    # on CPU, the MLPs', RMSNorms' and rotary elementwise work fused by torch.compile (train.fused)
    fused_elementwise: bool
    # importance weights of the rollout's sampled log-probs (algorithms.correction); None: off
    correction: RolloutCorrection | None
    # the rows of episodes cut by a limit leave the loss (train.loss_weights)
    mask_truncated: bool


@dataclass
class Models:
    """The trainable models of the update: the policy and, for estimators with a value baseline,
    a value head on its last hidden state."""

    policy: nn.Module
    value_head: nn.Module | None = None

    def parameters(self) -> list[nn.Parameter]:
        params = list(self.policy.parameters())
        return params + (list(self.value_head.parameters()) if self.value_head is not None else [])


MISMATCH = "logprob/mismatch"  # a maximum over micro-batches and ranks, where every other statistic is a sum
SHARED_TOKENS = "train/shared_prefix_tokens"  # prompt token passes the shared-prefix forward saved (train/prefix.py)


def mini_batch_indices(batch: ExperienceBatch, n: int) -> list[list[int]]:
    """Split sequences into ``n`` contiguous mini-batches (deterministic, same on every rank)."""
    s = batch.num_seqs
    bounds = [round(i * s / n) for i in range(n + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n)]


def _rollout_mismatch(mb: ExperienceBatch, old: torch.Tensor) -> float:
    """The largest gap between the rollout's sampled log-probs and ``old`` [B, T] (the log-probs
    of the weights it sampled with) over every generated token, kept in the loss or not."""
    generated = mb.padded("action_mask", 0.0)  # [B, T]
    if not generated.numel():
        return 0.0
    return float(((mb.padded("rollout_logprobs", 0.0) - old).abs() * generated).max())


def micro_batch_loss(
    models: Models,
    mb: ExperienceBatch,
    cfg: UpdateConfig,
    denom: dict[str, float],
    plan: PrefixPlan | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch, scaled so that summing over micro-batches and ranks gives the
    mini-batch loss (``plan``: its shared prompts, see :mod:`earl_lightning.train.prefix`).
    Returns the loss and un-normalized stat sums."""
    res = forward_micro_batch(
        models.policy,
        mb,
        temperature=cfg.temperature,
        value_head=models.value_head,
        with_entropy=True,
        allowed=cfg.allowed_token_ids,
        plan=plan,
        scored=cfg.scored_last_layer,
        chunked=cfg.causal_chunks,
        norm_backward=cfg.rms_norm_backward,
        fused=cfg.fused_elementwise,
    )
    mask = mb.padded("loss_mask", 0.0)  # [B, T]: the tokens that count (train.loss_weights)
    logp = mb.pad(res["logprobs"], 0.0)  # [B, T]
    old = logp.detach() if cfg.on_policy else mb.padded("old_logprobs", 0.0)  # [B, T]
    tok_loss, pstats = cfg.loss_fn(logp, old, mb.padded("advantages", 0.0), mask, **cfg.loss_params)
    tok_loss = tok_loss * mb.padded("is_weights", 0.0)  # the rollout correction's weights
    agg = dict(num_tokens=denom["tokens"], num_seqs=denom["seqs"], norm_constant=cfg.norm_constant)
    loss = aggregate(tok_loss, mask, cfg.aggregation, **agg)
    ent = mb.pad(res["entropy"], 0.0)  # [B, T]
    # this micro-batch's share of the mini-batch's tokens
    share = float(mask.sum()) / denom["tokens"]
    stats = {
        "loss/policy": float(loss.detach()),
        "policy/entropy": float((ent.detach() * mask).sum() / denom["tokens"]),
    }
    stats.update({f"policy/{k}": float(v) * share for k, v in loss_stat_means(pstats).items()})
    if cfg.on_policy and "rollout_logprobs" in mb.tokens:
        stats[MISMATCH] = _rollout_mismatch(mb, old)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * aggregate(ent, mask, cfg.aggregation, **agg)
    if cfg.kl_coef and "ref_logprobs" in mb.tokens:
        kl = kl_divergence(logp, mb.padded("ref_logprobs", 0.0), mask, cfg.kl_estimator)
        kl_loss = aggregate(kl, mask, cfg.aggregation, **agg)
        loss = loss + cfg.kl_coef * kl_loss
        stats["loss/kl"] = float(kl_loss.detach())
    if models.value_head is not None:
        v = mb.pad(res["values"], 0.0)
        vl, _ = value_loss(
            v, mb.padded("values", 0.0), mb.padded("returns", 0.0), mask, value_clip=cfg.value_clip
        )
        vloss = aggregate(vl, mask, "token_mean", num_tokens=denom["tokens"])
        loss = loss + cfg.value_coef * vloss
        stats["loss/value"] = float(vloss.detach())
    return loss, stats


def ppo_update(
    models: Models,
    optimizer: Any,
    scheduler: Any,
    batch: ExperienceBatch,
    cfg: UpdateConfig,
    reduce: Reducer,
    backward: Callable[[torch.Tensor], None],
) -> dict[str, float]:
    """``cfg.ppo_epochs`` passes of ``cfg.mini_batches`` optimizer steps over ``batch``.

    ``optimizer``: Lightning's optimizer wrapper; only the iteration's last step goes through it
    (its step advances ``trainer.global_step``, and one training step is one RL iteration), the
    others step the wrapped ``optimizer.optimizer``. ``scheduler`` (or None) steps after each
    optimizer step. ``backward``: ``LightningModule.manual_backward`` (precision plugins).
    Returns the step's metrics, summed over ranks (TP replicas once)."""
    batch, weighing = add_loss_weights(
        batch, cfg.correction, cfg.mask_truncated, cfg.micro_batch_tokens
    )
    totals: dict[str, float] = {}
    grad_norms = []
    for _epoch in range(cfg.ppo_epochs):
        for idx in mini_batch_indices(batch, cfg.mini_batches):
            _accumulate(models, batch.select(idx), cfg, reduce, backward, totals)
            reduce.sum_replicated_gradients(models.parameters())
            grad_norms.append(clip_gradients(models.parameters(), cfg.max_grad_norm))
            last = len(grad_norms) == cfg.ppo_epochs * cfg.mini_batches
            (optimizer if last else optimizer.optimizer).step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
    mismatch = totals.pop(MISMATCH, 0.0)  # a rank without micro-batches still takes part below
    keys = sorted(totals)
    out = {
        k: v / len(grad_norms) for k, v in zip(keys, reduce.sum_floats([totals[k] for k in keys]))
    }
    if cfg.on_policy:
        out[MISMATCH] = float(reduce.max(torch.tensor([mismatch], dtype=torch.float64))[0])
    out.update(_weight_metrics(weighing, cfg, reduce))
    out["grad_norm"] = float(sum(grad_norms) / max(1, len(grad_norms)))
    out["lr"] = float(optimizer.param_groups[0]["lr"])
    return out


def _accumulate(
    models: Models,
    mini: ExperienceBatch,
    cfg: UpdateConfig,
    reduce: Reducer,
    backward: Callable[[torch.Tensor], None],
    totals: dict[str, float],
) -> None:
    """Forward/backward every micro-batch of one mini-batch, gradients accumulating."""
    mask_tok = mini.tokens["loss_mask"]
    seqs_with_actions = float((mini.pad(mask_tok, 0.0).sum(-1) > 0).sum()) if mini.num_seqs else 0.0
    tokens, seqs = reduce.sum_floats([float(mask_tok.sum()), seqs_with_actions])
    denom = {"tokens": max(tokens, 1.0), "seqs": max(seqs, 1.0)}
    micro = mini.split_by_tokens(cfg.micro_batch_tokens) if mini.num_seqs else []
    # Every rank runs as many forward/backward passes as the busiest one, in lockstep (FSDP and TP
    # collectives inside each pass): agree on the count first, then pad with zero-loss passes. A
    # shared-prefix pass is two forwards: taken on all ranks or on none.
    for i in range(reduce.agree_count(len(micro))):
        mine = i < len(micro)
        plan = prefix_plan(models.policy, micro[i], cfg.share_prefix) if mine else None
        # a padding rank abstains
        shared = cfg.share_prefix and reduce.all(plan is not None or not mine)
        if not mine and not micro and i == 0:
            # a rank without rows of its own (all skipped, or fewer rows than ranks) runs its first
            # pass on a masked-out stand-in row: its statistics then have the names the other
            # ranks' have, whose sums are all-reduced below, name by name
            loss, stats = micro_batch_loss(models, _stand_in(mini), cfg, denom)
            stats[SHARED_TOKENS] = 0.0
            _add_stats(totals, stats)
            backward((loss + zero_loss(models.policy, models.value_head)) if shared else loss)
            continue
        if not mine:
            backward(zero_loss(models.policy, models.value_head, passes=2 if shared else 1))
            continue
        loss, stats = micro_batch_loss(models, micro[i], cfg, denom, plan if shared else None)
        stats[SHARED_TOKENS] = float(plan.saved_tokens) if shared else 0.0
        backward(loss)
        _add_stats(totals, stats)


def _weight_metrics(
    local: dict[str, float], cfg: UpdateConfig, reduce: Reducer
) -> dict[str, float]:
    """The rollout correction's and the truncated rows' figures over every rank (a collective when
    either is on, so every rank calls it)."""
    if cfg.correction is None and not cfg.mask_truncated:
        return {}
    totals = dict(zip(SUMMED, reduce.sum_floats([local[k] for k in SUMMED])))
    top = reduce.max(torch.tensor([local[k] for k in MAXED], dtype=torch.float64))
    totals.update(zip(MAXED, top.tolist()))
    return correction_metrics(totals, cfg.correction is not None, cfg.mask_truncated)


def _add_stats(totals: dict[str, float], stats: dict[str, float]) -> None:
    for k, v in stats.items():
        totals[k] = max(totals.get(k, 0.0), v) if k == MISMATCH else totals.get(k, 0.0) + v


def _stand_in(batch: ExperienceBatch) -> ExperienceBatch:
    """One row of one token with ``batch``'s fields, all zero (its action mask too): a forward
    and backward through every parameter that adds nothing to the loss."""

    def zero(t: torch.Tensor, name: str) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.long if name == "input_ids" else t.dtype, device=t.device)

    return ExperienceBatch(
        torch.tensor([0, 1], device=batch.cu_seqlens.device),
        {k: zero(v, k) for k, v in batch.tokens.items()},
        {k: zero(v, k) for k, v in batch.seqs.items()},
    )

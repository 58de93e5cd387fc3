"""A causal LM's forward pass over an :class:`ExperienceBatch`: per-token log-probs, entropy and
values of a micro-batch, and the no-grad pass that fills a batch's log-prob fields.

No Lightning here; the caller hands in the model placed for the stage's layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from earl_lightning.algorithms import (
    entropy,
    logprobs_from_logits,
    shifted_entropy,
    shifted_logprobs,
)
from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.models import eval_mode
from earl_lightning.models.lora import adapters_disabled
from earl_lightning.train.causal_chunks import causal_chunks
from earl_lightning.train.fused import fused_elementwise
from earl_lightning.train.prefix import PrefixPlan, prefix_plan, shared_prefix_forward
from earl_lightning.train.rms_norm import rms_norm_backward
from earl_lightning.train.scored import (
    MAX_SCORED_SHARE,
    can_score_last_layer,
    scatter_scored,
    scored_last_layer,
    scored_positions,
)


def forward_micro_batch(
    model,
    mb: ExperienceBatch,
    *,
    temperature: float,
    value_head=None,
    with_entropy: bool = False,
    allowed: list[int] | None = None,
    plan: PrefixPlan | None = None,
    scored: bool = False,
    chunked: bool = True,
    norm_backward: bool = True,
    fused: bool = True,
) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and values, entropy) of a micro-batch, unpadded back to [N].

    ``allowed``: the token ids the policy may generate (``--model.rollout.sampling.allowed_tokens``); log-probs and
    entropy are then over that set, as the rollout sampled them. ``plan``: run the prompts that
    several sequences share once, as planned by :func:`prefix_plan` (:mod:`earl_lightning.train.prefix`).
    ``scored``: run the last decoder layer only where the logits score an action token
    (:mod:`earl_lightning.train.scored`); log-probs and entropy elsewhere are then 0, for callers
    that mask them with ``action_mask`` (values too: GAE reads them on actions only). Taken only
    where it applies (no plan, a model :func:`can_score_last_layer` accepts, actions at most half
    the positions). ``chunked``: on CPU the layers' causal attention runs in query chunks where that
    is faster (:mod:`earl_lightning.train.causal_chunks`: the same numbers up to float rounding).
    ``norm_backward``: the RMSNorms' backward written out (:mod:`earl_lightning.train.rms_norm`:
    the same forward, gradients up to float rounding). ``fused``: on CPU, the MLPs', RMSNorms' and
    rotary embedding's elementwise work in kernels ``torch.compile`` fuses (:mod:`earl_lightning.train.fused`: the
    same numbers up to float rounding)."""
    allowed_t = (
        None
        if allowed is None
        else torch.as_tensor(allowed, dtype=torch.long, device=mb.tokens["input_ids"].device)
    )
    with (
        causal_chunks(model, chunked),
        rms_norm_backward(model, norm_backward),
        fused_elementwise(model, fused),
    ):
        return _forward(model, mb, temperature, value_head, with_entropy, allowed_t, plan, scored)


def _forward(model, mb, temperature, value_head, with_entropy, allowed, plan, scored):
    """:func:`forward_micro_batch` in its three ways: shared prefixes, the scored last layer, or
    the plain forward."""
    need_hidden = value_head is not None
    per_position = _per_position(temperature, allowed, with_entropy, value_head)
    if plan is not None:
        return shared_prefix_forward(model, mb, plan, per_position, need_hidden=need_hidden)
    if scored:
        res = _scored_forward(
            model,
            mb,
            temperature=temperature,
            with_entropy=with_entropy,
            allowed=allowed,
            value_head=value_head,
        )
        if res is not None:
            return res
    # Right padding needs no attention mask: under causal attention a real token never sees the
    # padding after it, and the padding's own outputs are dropped by ``unpad``. Without a mask the
    # attention runs its causal kernel instead of materialising an [S, heads, L, L] mask.
    input_ids = mb.padded("input_ids", 0)  # [S, L]
    out = model(input_ids=input_ids, output_hidden_states=need_hidden, use_cache=False)
    res = per_position(out.logits, input_ids, out.hidden_states[-1] if need_hidden else None)
    return {k: mb.unpad(v) for k, v in res.items()}


def _per_position(
    temperature: float, allowed: torch.Tensor | None, with_entropy: bool, value_head=None
):
    """``fn(logits, input_ids, hidden)``: the shifted log-probs (and entropy, values) of a
    forward's [R, C] positions from its logits (and last hidden states, with a value head)."""

    def per_position(logits, input_ids, hidden):
        logits = logits.float()  # [R, C, V]
        res = {
            "logprobs": shifted_logprobs(
                logits, input_ids, temperature=temperature, allowed=allowed
            )
        }
        if with_entropy:
            res["entropy"] = shifted_entropy(logits, temperature=temperature, allowed=allowed)
        if value_head is not None:
            v = value_head(hidden.float()).squeeze(-1)  # [R, C]: value of the state after token c
            # value before choosing token c
            res["values"] = torch.nn.functional.pad(v[:, :-1], (1, 0))
        return res

    return per_position


def _scored_forward(
    model,
    mb: ExperienceBatch,
    *,
    temperature: float,
    with_entropy: bool,
    allowed: torch.Tensor | None,
    value_head=None,
) -> dict[str, torch.Tensor] | None:
    """:func:`forward_micro_batch` through :func:`scored_last_layer`, or None where it does not pay or apply."""
    input_ids = mb.padded("input_ids", 0)  # [S, L]
    length = input_ids.shape[1]
    mask = mb.padded("action_mask", 0)
    if length < 2 or not bool((mask[:, 1:] > 0).any()) or not can_score_last_layer(model):
        return None
    pos = scored_positions(mask)
    if pos.width > MAX_SCORED_SHARE * length:
        return None
    with scored_last_layer(model, pos):
        out = model(
            input_ids=input_ids, use_cache=False, output_hidden_states=value_head is not None
        )
    logits = out.logits.float()  # [S, K, V]
    labels = input_ids.gather(1, pos.index + 1)
    res = {
        "logprobs": scatter_scored(
            logprobs_from_logits(logits, labels, temperature, allowed), pos, length
        )
    }
    if with_entropy:
        res["entropy"] = scatter_scored(entropy(logits, temperature, allowed), pos, length)
    # the value before choosing token t is read at t - 1: a scored position
    if value_head is not None:
        hidden = out.hidden_states[-1]  # [S, K, H]
        res["values"] = scatter_scored(value_head(hidden.float()).squeeze(-1), pos, length)
    return {k: mb.unpad(v) for k, v in res.items()}


@torch.no_grad()
def fill_logprobs(
    model,
    batch: ExperienceBatch,
    *,
    name: str,
    temperature: float,
    micro_batch_tokens: int,
    value_head=None,
    allowed: list[int] | None = None,
    share_prefix: bool = False,
    scored: bool = False,
    chunked: bool = True,
) -> ExperienceBatch:
    """Add per-token ``name`` log-probs (and ``values`` when a value head is given) to the batch.
    ``scored``: as in :func:`forward_micro_batch` (the tokens that are not actions then get 0);
    ``chunked`` as there."""
    out = {name: torch.zeros(batch.num_tokens)}
    if value_head is not None:
        out["values"] = torch.zeros(batch.num_tokens)
    for idx in batch.micro_batch_indices(micro_batch_tokens):
        mb = batch.select(idx)
        with eval_mode(model):  # the distribution the rollout sampled from (no dropout)
            res = forward_micro_batch(
                model,
                mb,
                temperature=temperature,
                value_head=value_head,
                allowed=allowed,
                plan=prefix_plan(model, mb, share_prefix),
                scored=scored,
                chunked=chunked,
            )
        pos = batch.token_positions(idx)
        out[name][pos] = res["logprobs"].cpu()
        if value_head is not None:
            out["values"][pos] = res["values"].cpu()
    tokens = dict(batch.tokens)
    tokens.update(out)
    return ExperienceBatch(batch.cu_seqlens, tokens, dict(batch.seqs))


def zero_loss(model, value_head=None, passes: int = 1) -> torch.Tensor:
    """A zero loss through every parameter, for ranks with fewer micro-batches than others:
    collective-backed parameters (FSDP, TP) need every rank in every forward/backward, as many
    forwards as the others run (``passes``: 2 where they share prefixes)."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    loss = torch.zeros((), device=device)
    for _ in range(passes):
        out = model(input_ids=ids, use_cache=False, output_hidden_states=value_head is not None)
        loss = loss + out.logits.sum() * 0.0
        if value_head is not None:
            loss = loss + value_head(out.hidden_states[-1].float()).sum() * 0.0
    return loss


def fill_experience(
    exp: ExperienceBatch,
    policy: nn.Module,
    value_head: nn.Module | None,
    *,
    old: bool,
    reference: nn.Module | None,
    adapters_off: bool,
    **kw: Any,
) -> ExperienceBatch:
    """The experience stage's forwards: the old log-probs (and values, with a value head) when
    ``old``, and the reference log-probs from ``reference`` or, with ``adapters_off``, from
    ``policy`` with its LoRA adapters off. ``kw``: :func:`fill_logprobs`'s settings."""
    if old:
        exp = fill_logprobs(policy, exp, name="old_logprobs", value_head=value_head, **kw)
    if reference is not None:
        exp = fill_logprobs(reference, exp, name="ref_logprobs", **kw)
    elif adapters_off:
        with adapters_disabled(policy) as base:
            exp = fill_logprobs(base, exp, name="ref_logprobs", **kw)
    return exp

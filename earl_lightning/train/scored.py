"""The last decoder layer at the scored positions only.

A policy loss reads the logits at the positions that predict an action token (``t - 1`` for each
``t`` with ``action_mask[t] = 1``) and nothing else. In the last decoder layer every other
position's output feeds only the logits nobody reads; what the scored positions need from the
others is their keys and values. So that layer runs its keys and values over the whole sequence,
and its queries, attention, output projection and MLP, the final norm and the LM head, at the
scored positions alone. In a multi-turn batch, where the actions are a small share of the tokens
(80 of 650 in the ten-turn benchmark), that is most of one layer's work and of its backward.

The numbers are those of the plain forward at the scored positions (up to float rounding: the
products have other shapes); the positions not scored get log-prob and entropy 0, which every
consumer of the train forward's outputs masks with ``action_mask``. The last layer's forward is
replaced for the one call, on the module itself, so hooks on the layer still run.

Supported where the layer is the Llama pattern (pre-norm attention with q/k/v/o projections and
rotary embeddings, then a pre-norm MLP): model types in :data:`SUPPORTED`, full attention only,
no activation checkpointing that recomputes (a switchable wrapper with recomputation off is fine).
:func:`can_score_last_layer` says whether a model qualifies; elsewhere
the caller runs the plain forward. Under FSDP2 the layer's hooks (all-gather, reshard) run as
always; under tensor parallelism the projections are the parallel modules themselves and the heads
are the rank's own (``view(..., -1, head_dim)``), as in the model's attention.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from earl_lightning.models.llama_layers import (
    SUPPORTED,
    has_llama_layers,
    last_layer,
    rope,
    rotate_half_of,
)
from earl_lightning.parallel.parallelize import recomputes_activations

__all__ = [
    "MAX_SCORED_SHARE",
    "SUPPORTED",
    "ScoredPositions",
    "can_score_last_layer",
    "last_layer",
    "scatter_scored",
    "scored_last_layer",
    "scored_positions",
]
# The share of a micro-batch's positions up to which the last layer runs at the scored positions
# only (above it the plain forward is as cheap); the layout selector's memory model is told it.
MAX_SCORED_SHARE = 0.5


@dataclass(frozen=True)
class ScoredPositions:
    """Per row, the positions whose logits score a token: ``index`` [B, K] (ascending; a row
    with fewer than K holds 0 in its spare slots) and ``valid`` [B, K]."""

    index: Tensor
    valid: Tensor

    @property
    def width(self) -> int:
        return int(self.index.shape[1])


def scored_positions(action_mask: Tensor) -> ScoredPositions:
    """The positions ``t - 1`` of the action tokens ``t`` of a right-padded ``[B, L]`` mask."""
    b, length = action_mask.shape
    scores = action_mask[:, 1:] > 0  # [B, L-1]: position t-1 predicts token t
    width = max(int(scores.sum(1).max()) if b else 0, 1)
    cols = torch.arange(length - 1, device=action_mask.device).expand(b, -1)
    order = torch.where(scores, cols, cols + length)  # scored positions first, in order
    index = order.sort(dim=1).values[:, :width]
    valid = index < length
    return ScoredPositions(torch.where(valid, index, torch.zeros_like(index)), valid)


def can_score_last_layer(model: nn.Module, *, now: bool = True) -> bool:
    """Whether :func:`scored_last_layer` can run on ``model`` (see the module doc); with
    ``now=False``, whether it can once the layers do not recompute (a switchable wrapper's
    recomputation is a per-step choice)."""
    from earl_lightning.rollout.backends.kv import full_attention_only

    # A layer that recomputes would rerun in backward after its forward is restored; a switchable
    # wrapper with recomputation off calls the layer as it is.
    return (
        has_llama_layers(model)
        and not recomputes_activations(model, now=now)
        and full_attention_only(model)
    )


def _gather(t: Tensor, index: Tensor) -> Tensor:
    """``t`` [B, L, D] at ``index`` [B, K] -> [B, K, D]."""
    return t.gather(1, index[..., None].expand(-1, -1, t.shape[-1]))


def _attention_at(attn: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, index: Tensor) -> Tensor:
    """The attention block's output at ``index`` [B, K] -> [B, K, hidden], keys and values from all of ``h``."""
    b, length, _ = h.shape
    width, d = index.shape[1], attn.head_dim
    rotate_half = rotate_half_of(attn)
    q = attn.q_proj(_gather(h, index)).view(b, width, -1, d)
    k = attn.k_proj(h).view(b, length, -1, d)
    v = attn.v_proj(h).view(b, length, -1, d).transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    # [1, L, D] where every row has the same positions
    cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)
    q = rope(q.transpose(1, 2), _gather(cos, index), _gather(sin, index), rotate_half)
    k = rope(k.transpose(1, 2), cos, sin, rotate_half)
    mask = (torch.arange(length, device=h.device) <= index[..., None])[
        :, None
    ]  # [B, 1, K, L]: causal
    dropout = float(getattr(attn, "attention_dropout", 0.0)) if attn.training else 0.0
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout,
        scale=attn.scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return attn.o_proj(out.transpose(1, 2).reshape(b, width, -1))


def _layer_forward(layer: nn.Module, index: Tensor):
    def forward(
        hidden_states: Tensor,
        *args,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> Tensor:
        if position_embeddings is None:
            raise RuntimeError(
                "the scored last layer needs the model to pass `position_embeddings` "
                "to its decoder layers (transformers >= 4.48)"
            )
        cos, sin = position_embeddings
        h = layer.input_layernorm(hidden_states)
        x = _gather(hidden_states, index) + _attention_at(layer.self_attn, h, cos, sin, index)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    return forward


@contextmanager
def scored_last_layer(model: nn.Module, positions: ScoredPositions) -> Iterator[None]:
    """Within the block, ``model(input_ids=...)`` returns logits [B, K, V] at ``positions`` only."""
    layer = last_layer(model)
    layer.forward = _layer_forward(layer, positions.index)
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


def scatter_scored(values: Tensor, positions: ScoredPositions, length: int) -> Tensor:
    """[B, K] values at the scored positions -> [B, L] in the experience convention (entry ``t``
    is the value for token ``t``, predicted at ``t - 1``); other entries 0."""
    out = values.new_zeros(values.shape[0], length)
    return out.scatter_add(1, positions.index + 1, values * positions.valid.to(values.dtype))

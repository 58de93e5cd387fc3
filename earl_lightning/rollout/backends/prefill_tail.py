"""The prefill's last decoder layer at the last column only.

A prefill forward (``HFBackend._prefill``) needs two things from the model: every layer's keys and
values at the new columns, for the cache, and the logits at the last column, to sample the first
token. In the last decoder layer nothing but the last column's output feeds the logits, so that
layer runs its keys and values over all the new columns (into the cache, as the model's attention
would) and its query, attention, output projection and MLP at the last column alone; the final
norm and the LM head then see ``[B, 1, hidden]``, which ``logits_to_keep=1`` reads as they would
have read the last column. The cache and the logits are those of the plain forward (up to float
rounding: the products have other shapes); the draws are the same
(``tests/unit/test_prefill_tail.py``).

A multi-turn prefill is tens of columns a turn (the observation and the chat scaffolding), so in
a shallow model this is a large share of the prefill's work (~40% of its time in the two-layer
earl-tiny); in a deep one, one layer's worth of the prefill less its keys and values.

The same Llama-pattern layers as the train forward's scored last layer
(:mod:`earl_lightning.models.llama_layers`), full attention only; the layer's ``forward`` is
replaced on the module for the call, so its hooks (FSDP's all-gather) still run. The attention is
the model's configured one (the backend's grouped-query SDPA in generation), called with one query
column and that column's row of the additive mask.

No Lightning here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from earl_lightning.models.llama_layers import has_llama_layers, last_layer, rope, rotate_half_of
from earl_lightning.rollout.backends.kv import full_attention_only


def can_prefill_tail(model: nn.Module) -> bool:
    """Whether :func:`last_column_only` applies to ``model`` (Llama-pattern layers, full attention)."""
    return has_llama_layers(model) and full_attention_only(model)


def model_attention(attn: nn.Module):
    """The model's configured attention function (its module's eager one by default)."""
    eager = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)


def _tail_forward(layer: nn.Module):
    attn = layer.self_attn
    rotate_half = rotate_half_of(attn)
    plain = type(layer).forward

    def forward(
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        if position_embeddings is None or past_key_values is None:
            return plain(
                layer,
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        cos, sin = position_embeddings  # [B, Q, D]
        b, q_len, _ = hidden_states.shape
        d = attn.head_dim
        h = layer.input_layernorm(hidden_states)
        q = attn.q_proj(h[:, -1:]).view(b, 1, -1, d)
        k = attn.k_proj(h).view(b, q_len, -1, d)
        v = attn.v_proj(h).view(b, q_len, -1, d).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = rope(q.transpose(1, 2), cos[:, -1:], sin[:, -1:], rotate_half)
        k = rope(k.transpose(1, 2), cos, sin, rotate_half)
        k, v = past_key_values.update(k, v, attn.layer_idx)
        mask = None if attention_mask is None else attention_mask[:, :, -1:]
        out, _ = model_attention(attn)(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        x = hidden_states[:, -1:] + attn.o_proj(out.reshape(b, 1, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    return forward


@contextmanager
def last_column_only(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block a cached forward's last decoder layer returns ``[B, 1, hidden]``: its
    output at the last column, having written every new column's keys and values to the cache.
    Does nothing where ``enabled`` is false or the model does not qualify (:func:`can_prefill_tail`)."""
    if not enabled or not can_prefill_tail(model):
        yield
        return
    layer = last_layer(model)
    layer.forward = _tail_forward(layer)
    try:
        yield
    finally:
        del layer.forward  # the class's forward again

"""A decode step of a Llama-pattern model, run through its modules without transformers' wrapping.

A decode step feeds one token per row. In a small model a large share of its time is not the
operators but the calls around them: the model's and the decoder body's ``forward`` (argument
checks, the output dataclasses, the mask preparation that a 4-D mask skips anyway, the
output-capture wrappers), each decoder layer's and attention module's ``__call__`` and ``forward``.
:func:`decode_logits` runs the same operators in the same order on the same modules (embedding, the
rotary module, per layer the norms, the q/k/v/o projections through the module, the rotation as the
model's own ``rotate_half``, the cache's ``update``, the configured attention function, the MLP
module; the final norm and the LM head) and returns the logits the model's forward would have given,
bit for bit (``tests/unit/test_decode_step.py``). It saves a few tenths of a millisecond a step (the
two-layer earl-tiny at 64 rows: a ten-turn rollout 1.12x faster, a twenty-turn one within noise,
``benchmarks/rollout_kv.py``'s ``kv_hf_forward``).

It applies (:func:`can_decode_direct`) only where nothing else hangs on those calls: Llama-pattern
layers (:mod:`earl_lightning.models.llama_layers`) with full attention through eager or SDPA
attention (:data:`PLAIN_ATTENTION`; a flash-attention kernel reads the position ids the layer hands
on), plain (not DTensor) parameters, and no hook, replaced ``forward`` or accelerate hook on the
model, its body, its layers or their attention modules. FSDP, tensor parallel, offloading and
instrumented models keep the model's own forward.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from earl_lightning.models.llama_layers import (
    decoder_layers,
    has_llama_layers,
    rope,
    rotate_half_of,
)
from earl_lightning.rollout.backends.kv import (
    GQA_SDPA,
    GQA_SDPA_ROWS,
    GQA_SDPA_ROWS_KERNEL,
    attention_masks,
    full_attention_only,
)
from earl_lightning.rollout.backends.prefill_tail import model_attention

# attention functions that read nothing but the query, keys, values, mask and scaling (the layer's
# own forward also hands its position ids and cache flags on; flash-attention kernels read those)
PLAIN_ATTENTION = ("eager", "sdpa", GQA_SDPA, GQA_SDPA_ROWS, GQA_SDPA_ROWS_KERNEL)
# rotary types whose frequencies do not depend on the positions a call sees (dynamic and longrope
# recompute theirs from the longest position: their rotary module runs at every step)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _layers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]] | None:
    """The decoder body and the layers its forward runs (the config's ``num_hidden_layers``)."""
    found = decoder_layers(model)
    if found is None:
        return None
    count = model.config.get_text_config().num_hidden_layers
    return found[0], list(found[1][:count])


def has_dtensor(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (sharded by FSDP2 or tensor parallel)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _untouched(module: nn.Module) -> bool:
    """No forward hook, no instance-level ``forward`` and no accelerate hook on ``module``."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or "forward" in module.__dict__
        or hasattr(module, "_hf_hook")
    )


def can_decode_direct(model: nn.Module) -> bool:
    """Whether :func:`decode_logits` gives what ``model``'s forward would (see the module's doc)."""
    if model.training or not has_llama_layers(model) or not full_attention_only(model):
        return False
    if getattr(model.config, "_attn_implementation", None) not in PLAIN_ATTENTION:
        return False
    found = _layers(model)
    if found is None or not hasattr(model, "lm_head"):
        return False
    body, layers = found
    if not all(hasattr(body, p) for p in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if torch.nn.modules.module._global_forward_hooks or (
        torch.nn.modules.module._global_forward_pre_hooks
    ):
        return False
    modules = [model, body, *layers, *(layer.self_attn for layer in layers)]
    if not all(_untouched(m) for m in modules):
        return False
    return not has_dtensor(model)


def rotary_table(
    model: nn.Module, first: int, end: int, like: Tensor
) -> tuple[Tensor, Tensor, int] | None:
    """The rotary module's cos and sin ``[end - first, head_dim]`` for positions ``first`` to
    ``end - 1``, computed once for a call's decode steps (``like``: a tensor of the model's dtype
    and device), and ``first``; None for a rotary type of changing frequencies (not in
    :data:`STATIC_ROPE`). The module's formula is elementwise in the position, so a row of the
    table is what a step's own call gives for that position."""
    rotary = model.get_decoder().rotary_emb
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE:
        return None
    cos, sin = rotary(like, torch.arange(first, end, device=like.device)[None])
    return cos[0], sin[0], first


@dataclass(frozen=True)
class DecodeParts:
    """What :func:`decode_logits` reads from a model, looked up once for a call's decode steps:
    the decoder body and, per layer, the layer, its ``rotate_half`` and its attention function (the
    one configured when looked up: under :func:`~earl_lightning.rollout.backends.kv.gqa_attention`
    in a generation call)."""

    body: nn.Module
    layers: tuple[tuple[nn.Module, Callable, Callable], ...]


def decode_parts(model: nn.Module) -> DecodeParts:
    """The :class:`DecodeParts` of a model :func:`can_decode_direct` accepts."""
    body, layers = _layers(model)
    return DecodeParts(
        body,
        tuple(
            (layer, rotate_half_of(layer.self_attn), model_attention(layer.self_attn))
            for layer in layers
        ),
    )


def decode_logits(
    model: nn.Module,
    ids: Tensor,
    positions: Tensor,
    mask: Tensor,
    cache: Any,
    rotary: tuple[Tensor, Tensor, int] | None = None,
    parts: DecodeParts | None = None,
) -> Tensor:
    """[B, V] next-token logits of one fed token per row: ``ids`` and ``positions`` [B, 1],
    ``mask`` the additive [B, 1, 1, K] mask, ``cache`` the transformers ``Cache`` the token's keys
    and values are written to; ``rotary``: a :func:`rotary_table` that covers the positions (else
    the rotary module runs); ``parts``: the call's :func:`decode_parts` (else looked up here)."""
    parts = decode_parts(model) if parts is None else parts
    body = parts.body
    x = body.embed_tokens(ids)
    if rotary is None:
        cos, sin = body.rotary_emb(x, positions)
    else:
        cos_t, sin_t, first = rotary
        at = positions - first
        cos, sin = cos_t[at], sin_t[at]
    b = ids.shape[0]
    for layer, rotate_half, attention in parts.layers:
        attn = layer.self_attn
        d = attn.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, 1, -1, d)
        k = attn.k_proj(h).view(b, 1, -1, d)
        v = attn.v_proj(h).view(b, 1, -1, d).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = rope(q.transpose(1, 2), cos, sin, rotate_half)
        k = rope(k.transpose(1, 2), cos, sin, rotate_half)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = attention(
            attn,
            q,
            k,
            v,
            mask,
            dropout=0.0,
            scaling=attn.scaling,
            sliding_window=getattr(attn, "sliding_window", None),
        )
        x = x + attn.o_proj(out.reshape(b, 1, -1).contiguous())
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(body.norm(x))[:, -1, :]


def step_masks(
    valid: Tensor, windows: dict[str, int | None], dtype: torch.dtype
) -> Callable[[int], Tensor | dict[str, Tensor]]:
    """``mask(col)``: the attention mask of the decode step that feeds column ``col``, as
    :func:`attention_masks` gives it once ``valid[:, col]`` holds the rows still active (``valid``
    [B, capacity]: the call's columns, updated in place step by step). A full-attention model's is
    one additive row per sequence kept across the steps: a column opens when it is fed, and closes
    after its step where its row had finished; other models' are built at each step."""
    if set(windows) != {"full_attention"}:
        return lambda col: attention_masks(
            valid[:, : col + 1], torch.tensor([col], device=valid.device), dtype, windows
        )
    low = torch.finfo(dtype).min
    row = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    row.masked_fill_(~valid, low)
    last: list[int] = []

    def mask(col: int) -> Tensor:
        if last:  # the previous step's column, for the rows that go on
            row[:, last[0]].masked_fill_(~valid[:, last[0]], low)
        row[:, col] = 0.0  # every query attends its own column
        last[:] = [col]
        return row[:, None, None, : col + 1]

    return mask

"""The train forward's causal attention in query chunks, on CPU.

PyTorch's CPU flash-attention kernel takes the queries in blocks (32 rows below 192 queries, 64
from 192, 256 from 768) and the keys in blocks of 512. Under ``is_causal`` a query block stops at
the key block that holds its diagonal, but computes that key block whole and masks what it cannot
see: at 650 positions (the ten-turn benchmark's episodes) every query block below position 512
computes all of the first 512 keys, 1.67 times the query-key pairs that causal attention needs.
Its time goes with the pairs it computes and hardly with the head size (head size 4 takes as long
as 32: the exponentials and block bookkeeping dominate, not the products).

Here a sequence of ``CHUNK_MIN``-plus positions runs in ``length // CHUNK_MIN`` query chunks, each
over the keys up to its own last query: the first chunk causal as before, the others with an
explicit causal mask (their queries see every earlier key). At 650 positions that is three chunks
and 1.33 times the pairs; chunks under ``CHUNK_MIN`` queries fall into the kernel's 32-row blocks,
which cost more a pair than they save. From ``CHUNK_BELOW`` positions the kernel's 256-row blocks
waste less and the chunks no longer pay (``benchmarks/train_cpu_paths.py`` measures both sides).

Each query's attention is computed over the keys it sees, as one call computes it, so the output
and gradients are the single call's up to float rounding (another block split sums in another
order). Applied where transformers' own ``sdpa`` attention would call the kernel with
``is_causal`` (no mask, as many keys as queries) on CPU without dropout; everything else goes to
``sdpa`` as it is. :func:`causal_chunks` routes a model's ``sdpa`` attention here for a block
(not for a model that recomputes activations in its backward).

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from earl_lightning.parallel.parallelize import recomputes_activations

NAME = "earl_sdpa_causal_chunks"
# the query length from which the CPU kernel takes 64-row query blocks: no chunk is shorter
CHUNK_MIN = 192
# the query length from which it takes 256-row blocks: from there on, one call
CHUNK_BELOW = 768


def chunk_bounds(length: int) -> list[int] | None:
    """The query chunks' boundaries ``[0, ..., length]`` for a causal attention over ``length``
    positions, or None where one call is as fast (shorter than two chunks, or from
    :data:`CHUNK_BELOW` on)."""
    if length < 2 * CHUNK_MIN or length >= CHUNK_BELOW:
        return None
    n = length // CHUNK_MIN
    return [round(length * i / n) for i in range(n + 1)]


def chunked_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, bounds: list[int], scale: float | None = None
) -> Tensor:
    """Causal attention of ``query`` [B, H, L, D] over ``key`` / ``value`` [B, KV, L, D] (``KV``
    dividing ``H``: grouped heads are broadcast), in the query chunks ``bounds`` gives; returns
    [B, L, H, D] (the layout transformers' attention functions return)."""
    b, heads, length, _ = query.shape
    out = query.new_empty(b, length, heads, value.shape[-1])
    gqa = heads != key.shape[1]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mask = None
        if lo:  # query lo + i sees keys 0 .. lo + i
            cols = torch.arange(hi, device=query.device)
            mask = cols[None, :] <= torch.arange(lo, hi, device=query.device)[:, None]
        part = F.scaled_dot_product_attention(
            query[:, :, lo:hi],
            key[:, :, :hi],
            value[:, :, :hi],
            attn_mask=mask,
            is_causal=not lo,
            scale=scale,
            enable_gqa=gqa,
        )
        out[:, lo:hi] = part.transpose(1, 2)
    return out


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, in query chunks where it would run the causal kernel on
    CPU (module docstring)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    bounds = chunk_bounds(query.shape[2])
    if (
        bounds is None
        or not causal
        or attention_mask is not None
        or key.shape[2] != query.shape[2]
        or query.device.type != "cpu"
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions", False)
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    return chunked_causal_attention(query, key, value, bounds, scaling), None


AttentionInterface.register(NAME, _attention)
# masks are made as for sdpa (a causal batch without padding gets none, so the chunks apply)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextmanager
def causal_chunks(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, a ``sdpa`` model's attention runs through the query chunks where they
    apply; other attention implementations, ``enabled=False``, and a model whose layers recompute
    their forward in the backward while gradients are recorded (the recomputation, outside the
    block, would run one call and save other tensors) are left alone."""
    config = getattr(model, "config", None)
    if (
        not enabled
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or (torch.is_grad_enabled() and recomputes_activations(model))
    ):
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"

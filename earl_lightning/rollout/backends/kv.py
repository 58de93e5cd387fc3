"""A batched, padded KV cache for a transformers causal LM, assembled from per-episode caches.

Each ``generate`` call packs its episodes into one ``[B, kv_heads, capacity, head_dim]`` buffer
per layer with a shared column layout, so every row writes the same columns at every step and
the model sees one ordinary batched forward::

    | cached prefix (left-padded) | new suffix (left-padded) | decoded tokens ... |
    0                          prefix_cols          decode_start             capacity

Holes (padding) are excluded by an explicit 4-D attention mask and explicit ``position_ids``
(RoPE positions are each episode's true positions), so the numbers equal an unpadded forward.
After the call the buffer stays as it is (a :class:`ResidentKV`), each episode pointing at its row.
When every request of the next call continues an episode of one such buffer, that buffer becomes
the next call's prefix as a whole, rows selected in one copy per layer, holes and all (see
:meth:`ResidentKV.fits`); otherwise each row's valid columns are copied out and packed again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

GQA_SDPA = "earl_sdpa_gqa"
GQA_SDPA_ROWS = "earl_sdpa_gqa_rows"
GQA_SDPA_ROWS_KERNEL = "earl_sdpa_gqa_rows_kernel"


@dataclass
class ResidentKV:
    """The packed buffer one ``generate`` call left: per layer ``(keys, values)``, each
    ``[B, kv_heads, capacity, head_dim]``, and ``valid`` ``[B, cols]``: the columns each row fed
    (its prompt and all its generated tokens but the last)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor

    # A buffer is reused whole while its width stays within this factor of the longest row it
    # holds: holes (padding, a finished row's unused columns) cost attention work every step.
    MAX_WIDTH_OVER_LONGEST = 1.25

    def fits(self, rows_valid: torch.Tensor) -> bool:
        """Whether the chosen rows' part of the buffer (their ``valid``, ``[b, cols]``) is worth
        reusing whole rather than repacking."""
        longest = int(rows_valid.sum(1).max())
        return rows_valid.shape[1] <= self.MAX_WIDTH_OVER_LONGEST * max(longest, 1)


@dataclass
class EpisodeKV:
    """One episode's cache: the token ids it encodes and either per-layer ``(keys, values)``,
    each ``[kv_heads, len(ids), head_dim]``, or its ``row`` of a ``resident`` buffer."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    resident: ResidentKV | None = None
    row: int = -1

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(keys, values)``, ``[kv_heads, len(ids), head_dim]``."""
        if self.layers is not None:
            return self.layers[i]
        cols = self.resident.valid[self.row].nonzero().flatten()
        return row_columns(*self.resident.layers[i], self.row, cols)


def row_columns(
    keys: torch.Tensor, values: torch.Tensor, row: int, cols: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous ``[kv_heads, len(cols), head_dim]`` copy of one row's chosen columns of a
    ``[B, kv_heads, capacity, head_dim]`` buffer's keys and values."""
    return keys[row].index_select(1, cols), values[row].index_select(1, cols)


class PaddedKVLayer(CacheLayerMixin):
    """One layer of the packed buffer. The buffer is allocated on the first ``update`` (when the
    head count and head size are known) and the cached prefixes are copied in right then."""

    is_sliding = False

    def __init__(
        self,
        capacity: int,
        prefix_cols: int,
        prefixes: list[tuple[torch.Tensor, torch.Tensor] | None],
        whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        super().__init__()
        self.capacity, self.prefix_cols, self.prefixes = capacity, prefix_cols, prefixes
        self.whole = whole  # (keys, values, rows) of a resident buffer whose first prefix_cols columns are the prefix
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        # No column may hold uninitialised memory: padded columns are masked out, but masked
        # attention still multiplies their values by a zero weight, and 0 * NaN would be NaN. A
        # resident buffer's prefix is copied whole (every column of it was zeroed or written), so
        # only the columns after it are zeroed.
        if self.whole is not None:
            keys, values, rows = self.whole
            n = self.prefix_cols
            self.keys = _empty_after(key_states, (b, h, self.capacity, d), n)
            self.values = _empty_after(value_states, (b, h, self.capacity, d), n)
            if _is_identity(rows, keys.shape[0]):  # every row continues, in order: no gather
                self.keys[:, :, :n] = keys[:, :, :n]
                self.values[:, :, :n] = values[:, :, :n]
            else:
                self.keys[:, :, :n] = keys[:, :, :n].index_select(0, rows)
                self.values[:, :, :n] = values[:, :, :n].index_select(0, rows)
            self.whole = None
        else:
            self.keys = key_states.new_zeros(b, h, self.capacity, d)
            self.values = value_states.new_zeros(b, h, self.capacity, d)
        for row, kv in enumerate(self.prefixes):
            if kv is not None:
                n = kv[0].shape[1]
                self.keys[row, :, self.prefix_cols - n : self.prefix_cols] = kv[0]
                self.values[row, :, self.prefix_cols - n : self.prefix_cols] = kv[1]
        self.prefixes = []  # the per-episode copies are no longer needed by this layer
        self.length = self.prefix_cols
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV buffer overflow: {end} columns > capacity {self.capacity}")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def extract(self, row: int, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A contiguous ``[kv_heads, len(cols), head_dim]`` copy of one row's chosen columns."""
        return row_columns(self.keys, self.values, row, cols)


def _empty_after(like: torch.Tensor, shape: tuple[int, ...], n: int) -> torch.Tensor:
    """An uninitialised buffer of ``shape`` whose columns from ``n`` on (dim 2) are zero."""
    out = like.new_empty(shape)
    out[:, :, n:].zero_()
    return out


def _is_identity(rows: torch.Tensor, num_rows: int) -> bool:
    """Whether ``rows`` selects every one of ``num_rows`` rows in order."""
    return rows.numel() == num_rows and bool(
        torch.equal(rows, torch.arange(num_rows, device=rows.device))
    )


def build_cache(
    num_layers: int,
    capacity: int,
    prefix_cols: int,
    entries: list[EpisodeKV | None],
    whole: tuple[ResidentKV, torch.Tensor, torch.Tensor] | None = None,
) -> Cache:
    """A transformers ``Cache`` whose layers are :class:`PaddedKVLayer` with the rows' prefixes:
    ``whole`` = (a resident buffer, the rows to take from it, in order, and their ``valid``) as
    :func:`common_resident` gives it, else each entry's own."""
    if whole is not None:
        res, rows, _ = whole
        layers = [
            PaddedKVLayer(capacity, prefix_cols, [], (*res.layers[i], rows))
            for i in range(num_layers)
        ]
    else:
        layers = [
            PaddedKVLayer(
                capacity, prefix_cols, [e.layer(i) if e is not None else None for e in entries]
            )
            for i in range(num_layers)
        ]
    return Cache(layers=layers)


def common_resident(
    entries: list[EpisodeKV | None],
) -> tuple[ResidentKV, torch.Tensor, torch.Tensor] | None:
    """(buffer, rows, the rows' ``valid`` [b, cols]) when every entry is a row of one resident
    buffer worth reusing whole."""
    first = entries[0] if entries else None
    res = first.resident if first is not None else None
    if res is None or any(e is None or e.resident is not res for e in entries):
        return None
    rows = torch.tensor([e.row for e in entries], dtype=torch.long, device=res.valid.device)
    rows_valid = res.valid.index_select(0, rows)
    return (res, rows, rows_valid) if res.fits(rows_valid) else None


def additive_mask(
    valid: torch.Tensor, query_cols: torch.Tensor, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """[B, 1, Q, K] additive attention mask from ``valid`` [B, K] and the query columns [Q].

    Query ``q`` may attend column ``k`` iff ``k`` holds a real token and ``k <= query_cols[q]``;
    with a sliding ``window`` also only if the two tokens are fewer than ``window`` positions
    apart (transformers' rule: ``pos_q - pos_k < window``). A row's real tokens are its
    consecutive positions in column order, so a token's position is the count of real columns
    before it. Every query also attends its own column: a padding query then never has an
    empty row (which would make SDPA return NaN), and real rows are unaffected since a real
    query's own column is valid anyway.
    """
    k = valid.shape[1]
    cols = torch.arange(k, device=valid.device)
    causal = cols[None, :] <= query_cols[:, None]  # [Q, K]
    allowed = valid[:, None, :] & causal[None]  # [B, Q, K]
    if window is not None:
        pos = valid.long().cumsum(-1)  # [B, K]: 1 + position of each real column
        near = (pos[:, query_cols][:, :, None] - pos[:, None, :]) < window  # [B, Q, K]
        allowed = allowed & near
    allowed = allowed | (cols[None, :] == query_cols[:, None])[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def attention_windows(config: Any) -> dict[str, int | None]:
    """The attention kinds a transformers config's layers use, each with its window (None =
    full causal attention): ``{"full_attention": None}`` for an ordinary model,
    ``{"sliding_attention": 128}`` when every layer attends to the last 128 tokens only."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = (
        getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True)
        else None
    )
    # A config without per-layer types (Mistral) windows every layer when it names a window.
    kinds = getattr(config, "layer_types", None) or [
        "sliding_attention" if window else "full_attention"
    ]
    out: dict[str, int | None] = {}
    for kind in kinds:
        if kind == "full_attention":
            out[kind] = None
        elif kind == "sliding_attention" and window:
            out[kind] = int(window)
        else:
            raise ValueError(
                f"layer type {kind!r} (sliding_window={window!r}) is not supported by the "
                f"KV-reusing HF backend; supported: full_attention, sliding_attention"
            )
    return out


def full_attention_only(model: Any) -> bool:
    """Whether every layer of ``model`` attends to the whole context, as :func:`attention_windows`
    reads its config (False for a sliding window, a layer type it does not know, or no HF config)."""
    try:
        return all(w is None for w in attention_windows(model.config).values())
    except (AttributeError, ValueError):
        return False


def attention_masks(
    valid: torch.Tensor,
    query_cols: torch.Tensor,
    dtype: torch.dtype,
    windows: dict[str, int | None],
) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`additive_mask` per attention kind: one tensor for an all-full-attention model, else
    the ``{layer_type: mask}`` mapping transformers' decoder models accept as ``attention_mask``."""
    if set(windows) == {"full_attention"}:
        return additive_mask(valid, query_cols, dtype)
    return {kind: additive_mask(valid, query_cols, dtype, w) for kind, w in windows.items()}


def _sdpa_gqa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that broadcasts grouped KV heads instead of copying them.

    transformers' own SDPA path repeats the KV heads whenever a mask is given on CPU, i.e. it
    copies the whole cache on every decode step, which made that copy the largest cost of a
    multi-turn decode. ``enable_gqa`` gives the same numbers without the copy.
    """
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _sdpa_gqa_rows_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    matmul: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`_sdpa_gqa_attention`, and in a decode step (one query per row) the query heads that
    share a KV head become query rows of that head, so each cached KV head is read once (CPU's flash
    kernel reads it once per query head under ``enable_gqa``). The numbers are the same attention:
    every head of a row has the same [B, 1, 1, K] mask, which broadcasts over the rows.

    With ``matmul`` on CPU the step is two batched matrix products (the scores, then the values):
    with a few query rows per KV head SDPA's flash kernel spends its time on per-head set-up, and
    the products made a ten- and a twenty-turn rollout 1% and 5% faster
    (``benchmarks/rollout_kv.py``: ``kv_reuse`` against ``kv_sdpa_rows``). Elsewhere SDPA takes
    the rows."""
    b, heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    if (
        q_len != 1
        or heads == kv_heads
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    ):
        return _sdpa_gqa_attention(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    rows = query.reshape(b, kv_heads, heads // kv_heads, d)  # query head i -> KV head i // group
    if matmul and query.device.type == "cpu":
        scores = torch.matmul(rows, key.transpose(-1, -2))  # [B, kv_heads, group, K]
        scores.mul_(d**-0.5 if scaling is None else scaling)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            scores.masked_fill_(~attention_mask, float("-inf"))
        elif attention_mask is not None:
            scores.add_(attention_mask)
        out = torch.matmul(scores.softmax(-1), value)
    else:
        out = F.scaled_dot_product_attention(
            rows, key, value, attn_mask=attention_mask, scale=scaling
        )
    return out.reshape(b, 1, heads, d), None


# the rows through SDPA's kernel on every device (``HFBackend(decode_matmul=False)``)
_sdpa_gqa_rows_kernel_attention = functools.partial(_sdpa_gqa_rows_attention, matmul=False)

AttentionInterface.register(GQA_SDPA, _sdpa_gqa_attention)
AttentionInterface.register(GQA_SDPA_ROWS, _sdpa_gqa_rows_attention)
AttentionInterface.register(GQA_SDPA_ROWS_KERNEL, _sdpa_gqa_rows_kernel_attention)


@contextlib.contextmanager
def gqa_attention(
    model: Any, decode_rows: bool = True, decode_matmul: bool = True
) -> Iterator[None]:
    """Route a ``sdpa`` model's attention through :func:`_sdpa_gqa_attention` for the duration
    (generation only; other implementations are left alone); with ``decode_rows`` through
    :func:`_sdpa_gqa_rows_attention` (``decode_matmul``: a decode step's two matrix products on
    CPU) or :func:`_sdpa_gqa_rows_kernel_attention` (SDPA's kernel everywhere)."""
    config = model.config
    if config._attn_implementation != "sdpa":
        yield
        return
    rows = GQA_SDPA_ROWS if decode_matmul else GQA_SDPA_ROWS_KERNEL
    config._attn_implementation = rows if decode_rows else GQA_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"

"""The sizes of a decoder-only transformer that its memory depends on, read from a transformers
config, and the elements one of its layers holds per token in each kind of pass (measured on the
project's own code paths; :mod:`earl_lightning.parallel.memory` builds its estimates from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from earl_lightning.core.checks import check_count


@dataclass(frozen=True)
class ModelSizes:
    """The sizes of a decoder-only transformer that its memory depends on."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = True
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                check_count(f"model_config.{f.name}", v)

    @classmethod
    def from_config(cls, config: Any) -> ModelSizes:
        """From a transformers config (Qwen2, Llama, ...) or a ``ModelSizes``."""
        if isinstance(config, ModelSizes):
            return config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        inter = getattr(config, "intermediate_size", None)
        # GPT-2 family: n_inner, None meaning 4 x hidden
        if inter is None and hasattr(config, "n_inner"):
            inter = config.n_inner or 4 * config.hidden_size
        need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
        missing = [n for n in need if getattr(config, n, None) is None] + (
            [] if inter else ["intermediate_size"]
        )
        if missing:
            raise ValueError(
                f"`model_config` {type(config).__name__} lacks {missing}; pass a transformers config "
                f"of a decoder-only LM or a ModelSizes"
            )
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=inter,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bool(
                getattr(config, "attention_bias", getattr(config, "model_type", "") == "qwen2")
            ),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attn + bias + 3 * h * i + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return (
            self.embedding_params + lm_head + self.num_layers * self.layer_params + self.hidden_size
        )

    def saved_per_token(self, tp: int) -> float:
        """Elements one decoder layer saves for backward per token. Measured on Qwen2 (sdpa):
        8h + 4i + 2kv + heads + 2; the norms and the residual stream (5h + 2) stay replicated under
        tensor parallelism, the attention and MLP internals are split across the tp ranks."""
        h, i = self.hidden_size, self.intermediate_size
        return 5 * h + 2 + (3 * h + 4 * i + 2 * self.kv_dim + self.num_heads) / tp

    def inference_per_token(self, tp: int) -> float:
        """Elements alive per token inside one layer of a no-grad forward (measured: 4h + 3i):
        one layer at a time, since nothing is kept for backward."""
        return 4 * self.hidden_size + 3 * self.intermediate_size / tp

    def recompute_per_token(self, tp: int) -> float:
        """Extra elements per token while a checkpointed layer runs its backward: the layer's saved
        activations are rebuilt, plus the gradient buffers in flight (measured: about h + i)."""
        return self.saved_per_token(tp) + self.hidden_size + self.intermediate_size / tp

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> float:
        # KV heads split across tp; an engine replicates them when tp exceeds their number.
        kv_heads = math.ceil(self.num_kv_heads / tp)
        return self.num_layers * kv_heads * self.head_dim * 2 * dtype_bytes

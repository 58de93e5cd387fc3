"""The parts of a Llama-pattern decoder layer that the fast paths run themselves.

The train forward's last layer at the scored positions (``train/scored.py``) and the rollout
prefill's last layer at the last column (``rollout/backends/prefill_tail.py``) both call a
transformers decoder layer's own modules (norms, q/k/v/o projections, MLP) and its module's
``rotate_half``, on other positions than the model would. This is what they share: finding the
layer, checking it has the pattern (pre-norm attention with q/k/v/o projections and rotary
embeddings, then a pre-norm MLP), and the rotary formula as the models write it.

No Lightning here; only torch.
"""

from __future__ import annotations

import sys

from torch import Tensor, nn

# model types whose decoder layers are this pattern
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")


def text_config(model: nn.Module):
    """The model's (text) config, or None where it has none."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """The decoder body of a transformers causal LM (``get_decoder()``) and its ``layers`` (None
    where the model has no ``model.layers``)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(body, "layers", None)
    return None if layers is None else (body, layers)


def last_layer(model: nn.Module) -> nn.Module | None:
    """The last decoder layer of a transformers causal LM, inside its checkpoint wrapper if it has
    one (None where the model has no ``model.layers``)."""
    found = decoder_layers(model)
    if found is None or not len(found[1]):
        return None
    layers = found[1]
    return getattr(layers[-1], "_checkpoint_wrapped_module", layers[-1])


def rotate_half_of(attn: nn.Module):
    """The ``rotate_half`` of the module that defines ``attn``'s class (None where it has none)."""
    return getattr(sys.modules.get(type(attn).__module__), "rotate_half", None)


def has_llama_layers(model: nn.Module) -> bool:
    """Whether the model's type is in :data:`SUPPORTED` and its last layer has every part the fast
    paths call (the attention window and activation recomputation are the callers' to check)."""
    config = text_config(model)
    if getattr(config, "model_type", None) not in SUPPORTED:
        return False
    layer = last_layer(model)
    if layer is None or not all(hasattr(layer, p) for p in LAYER_PARTS):
        return False
    attn = layer.self_attn
    return (
        all(hasattr(attn, p) for p in (*ATTN_PARTS, "head_dim", "scaling"))
        and rotate_half_of(attn) is not None
    )


def rope(x: Tensor, cos: Tensor, sin: Tensor, rotate_half) -> Tensor:
    """Rotary embedding of ``x`` [B, H, T, D] with ``cos``/``sin`` [B, T, D] (the models' own formula)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]

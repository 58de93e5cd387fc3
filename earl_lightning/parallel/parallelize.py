"""Apply a :class:`Layout` to a HF decoder-only causal LM: tensor parallel, activation
checkpointing, then FSDP2 over the data-parallel mesh dimension.

No Lightning import: the strategy calls :func:`parallelize_model` and so can a plain script.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
)
from torch.distributed.device_mesh import DeviceMesh

from earl_lightning.models.lora import copy_lora, has_lora
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.plans import (  # noqa: F401 (re-exported)
    apply_tensor_parallel,
    decoder_units,
    reject_unplanned_tp,
    replace_module,
)


def reject_fsdp1(model: nn.Module, arg: str = "model") -> None:
    """FSDP1 flattens parameters into FlatParameters that neither DTensor TP nor the reshard understand."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel) or any(
        isinstance(m, FullyShardedDataParallel) for m in model.modules()
    ):
        raise TypeError(
            f"`{arg}` is wrapped in torch.distributed.fsdp.FullyShardedDataParallel (FSDP1); EarlStrategy shards "
            "models itself with FSDP2 (`fully_shard`) and tensor parallel. Pass the plain HF model instead."
        )


def reject_lora_tp(model: nn.Module, layout: Layout, arg: str = "layout") -> None:
    """Tensor parallel shards ``nn.Linear`` weights; a LoRA layer is not one (its adapters would
    need a plan of their own), so adapters train data-parallel only."""
    if has_lora(model):
        refuse_lora_tp(layout, arg)


def refuse_lora_tp(layout: Layout, arg: str = "layout") -> None:
    """:func:`reject_lora_tp` for a model known to carry adapters before it is built."""
    if layout.tp_enabled:
        raise ValueError(
            f"`{arg}` has tp={layout.tp}, but the model carries LoRA adapters (--model.peft), which "
            "EarlStrategy does not shard with tensor parallel; use tp=1 layouts (data parallel, FSDP) "
            "or full fine-tuning"
        )


def model_heads(model: nn.Module) -> tuple[int, int]:
    """(attention heads, KV heads) from a HF config; TP must divide both."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_attention_heads"):
        raise TypeError(
            f"expected a HF causal LM with a `config.num_attention_heads`, got {type(model).__name__}"
        )
    heads = int(cfg.num_attention_heads)
    return heads, int(getattr(cfg, "num_key_value_heads", None) or heads)


class SwitchableCheckpointWrapper(CheckpointWrapper):
    """torch's checkpoint wrapper (same parameter and state-dict names) that recomputes only while
    ``enabled`` and autograd records; otherwise a plain call of the layer. A run can so switch
    checkpointing per step without re-wrapping a sharded model."""

    enabled: bool = True

    def forward(self, *args, **kwargs):
        if self.enabled and torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        return self._checkpoint_wrapped_module(*args, **kwargs)


def apply_activation_checkpointing(model: nn.Module, enabled: bool = True) -> None:
    """Recompute each decoder layer in backward: memory ∝ one layer's activations, +1 forward.
    ``enabled=False`` wraps the layers but leaves recomputation off until
    :func:`set_activation_checkpointing` turns it on."""
    for name, layer in decoder_units(model):
        if isinstance(layer, CheckpointWrapper):
            continue
        wrapper = SwitchableCheckpointWrapper(
            layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False
        )
        wrapper.enabled = enabled
        replace_module(model, name, wrapper)


def is_checkpoint_switchable(model: nn.Module) -> bool:
    """Whether ``model``'s decoder layers carry switchable checkpoint wrappers."""
    return any(isinstance(m, SwitchableCheckpointWrapper) for m in model.modules())


def recomputes_activations(model: nn.Module, *, now: bool = True) -> bool:
    """Whether a layer of ``model`` reruns its forward in backward: HF gradient checkpointing, or a
    checkpoint wrapper that recomputes. With ``now=False`` a switchable wrapper does not count (its
    recomputation is a per-step choice); torch's own wrapper always does."""
    if getattr(model, "is_gradient_checkpointing", False):
        return True
    return any(
        isinstance(m, CheckpointWrapper) and (not hasattr(m, "enabled") or (now and m.enabled))
        for m in model.modules()
    )


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn recomputation of the wrapped decoder layers on or off (see :func:`apply_activation_checkpointing`)."""
    if not is_checkpoint_switchable(model):
        raise ValueError(
            "the model's layers are not wrapped for activation checkpointing; parallelize it with "
            "`checkpoint_switchable=True` (or a layout with activation_checkpointing=True)"
        )
    for m in model.modules():
        if isinstance(m, SwitchableCheckpointWrapper):
            m.enabled = bool(enabled)


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool = True
) -> None:
    """FSDP2 per decoder layer (overlaps one layer's all-gather with the previous layer's compute)
    and at the root (embeddings, final norm, LM head; a tied weight is one parameter there)."""
    from torch.distributed.fsdp import fully_shard

    layers = [layer for _, layer in decoder_units(model)]
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again first in backward: keep them gathered.
        fully_shard(
            layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and i < len(layers) - 1
        )
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # Losses are normalized by the GLOBAL token count on every rank, so the dp gradients must be
    # summed, not averaged, for a sharded update to equal the single-process one. Plain SUM
    # collectives (no PREMUL_SUM / AVG) are also the only reductions gloo implements.
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parallelize_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None,
    layout: Layout,
    reshard_after_forward: bool = True,
    fsdp: bool = True,
    checkpoint_switchable: bool = False,
) -> nn.Module:
    """Shard ``model`` in place for ``layout`` on ``mesh`` (dims ``("dp", "tp")``) and return it.

    Order: tensor parallel first, because TP replaces ``nn.Linear`` weights by DTensors that FSDP2
    must then shard along the *other* mesh dim (2-D placements); FSDP on top of TP is the
    composition FSDP2 supports, the reverse is not. Activation checkpointing wraps the decoder layers
    after TP (so recomputation replays TP's collectives too) and before FSDP (so FSDP's per-layer
    groups contain the checkpoint wrappers and their all-gathers are re-issued in recomputation).

    ``checkpoint_switchable=True`` wraps the layers for checkpointing even when the layout does not
    ask for it (recomputation off), so :func:`set_activation_checkpointing` can switch it per step.

    ``fsdp=False`` keeps parameters replicated across dp (inference replicas for rollout). With
    ``layout.world_size == 1`` the model is returned unchanged (the single-process trainer).
    HF attention reshapes q/k/v with ``view(*input_shape, -1, head_dim)``, so it infers the local
    head count under TP; ``num_key_value_groups`` is a ratio and stays valid when both head counts
    are divided by tp.
    """
    reject_fsdp1(model)
    reject_lora_tp(model, layout)
    reject_unplanned_tp(model, layout)
    heads, kv_heads = model_heads(model)
    layout.check_heads(heads, kv_heads)
    wrap = layout.activation_checkpointing or checkpoint_switchable
    if layout.world_size == 1:
        if wrap:
            apply_activation_checkpointing(model, enabled=layout.activation_checkpointing)
        return model
    if (
        mesh is None
        or tuple(mesh.mesh_dim_names or ()) != ("dp", "tp")
        or tuple(mesh.shape) != (layout.dp, layout.tp)
    ):
        raise ValueError(
            f"`mesh` must be a ('dp', 'tp') DeviceMesh of shape ({layout.dp}, {layout.tp}), got {mesh}"
        )
    if layout.tp_enabled:
        apply_tensor_parallel(model, mesh["tp"])
    if wrap:
        apply_activation_checkpointing(model, enabled=layout.activation_checkpointing)
    if fsdp and layout.dp_enabled:
        apply_fsdp(model, mesh["dp"], reshard_after_forward=reshard_after_forward)
    return model


def build_replica(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None,
    layout: Layout,
    device: torch.device | str,
    fsdp: bool = False,
) -> nn.Module:
    """An empty copy of ``model``'s architecture placed for ``layout`` (weights uninitialized; fill
    them with a reshard). Built on the meta device, so no full-size copy is ever materialized.

    Buffers (rotary ``inv_freq``...) are neither sharded nor saved, so they are copied from ``model``.
    """
    config = model.config
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        replica = type(model)(config).to(dtype)
        copy_lora(model, replica)  # the same parameters, so a reshard maps every one
    parallelize_model(replica, mesh=mesh, layout=layout, fsdp=fsdp)
    replica.to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):
        replica.tie_weights()
    src_buffers = {_strip_wrappers(n): b for n, b in model.named_buffers()}
    with torch.no_grad():
        for name, buf in replica.named_buffers():
            buf.copy_(src_buffers[_strip_wrappers(name)])
    replica.eval()
    for p in replica.parameters():
        p.requires_grad_(False)
    return replica


def _strip_wrappers(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")

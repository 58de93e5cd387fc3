"""Where a transformers causal LM is cut for parallelism, read from the model itself.

* Decoder blocks (the FSDP units and the activation-checkpointed modules): the submodules whose
  class is named in the model's ``_no_split_modules`` (transformers' list of blocks that must stay
  whole on one device), outermost only; fallback ``model.model.layers``.
* The tensor-parallel plan: the config's ``base_model_tp_plan`` (transformers' own, keyed by
  patterns such as ``"layers.*.self_attn.q_proj"`` relative to the base model) with its style
  strings mapped onto torch's ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``.
  The embedding and the LM head are always sharded on the vocabulary (as before this module).

No Lightning import (``earl_lightning.parallel`` is usable from a plain script).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from earl_lightning.parallel.layout import Layout

# transformers' style strings EarlStrategy maps (the others are refused by name): colwise splits a
# Linear's output features across TP ranks, rowwise its input features (then all-reduces); the
# "gather"/"rep"/"split_input" variants replicate the activation at that boundary instead of
# passing the shard on (fused qkv / gate_up projections, whose split is not per head);
# "replicated_with_grad_allreduce" keeps a per-head norm's weight whole on every rank, its input
# sharded on the heads dim (-2), and sums its gradient across TP ranks (Qwen3 / Gemma3 q_norm, k_norm).
SUPPORTED_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "colwise_gather_output",
    "rowwise_split_input",
    "replicated_with_grad_allreduce",
)


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicated_with_grad_allreduce":
        # [batch, seq, heads, head_dim]: heads are TP-sharded
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    raise AssertionError(name)


def model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def base_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The config's ``base_model_tp_plan`` (None or empty: the model has none), less its entry for
    the token embedding (sharded on the vocabulary here, like the LM head)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        return None
    base = getattr(model, "base_model", model)
    embed = (
        _name_of(base, model.get_input_embeddings())
        if hasattr(model, "get_input_embeddings")
        else None
    )
    return {k: v for k, v in plan.items() if k != embed}


def tp_plan_error(model: nn.Module) -> str | None:
    """Why ``model`` cannot be tensor-parallel (one line), or None when its plan maps."""
    plan = base_tp_plan(model)
    if plan is None:
        return (
            f"model type {model_type(model)} has no tensor-parallel plan (base_model_tp_plan); "
            "use tp=1 layouts"
        )
    for key, style in plan.items():
        if style not in SUPPORTED_STYLES:
            return (
                f"model type {model_type(model)}: tensor-parallel style {style!r} (for {key!r}) is not "
                f"supported by EarlStrategy (supported: {', '.join(SUPPORTED_STYLES)}); use tp=1 layouts"
            )
    return None


def supports_tp(model: nn.Module) -> bool:
    return tp_plan_error(model) is None


def reject_unplanned_tp(model: nn.Module, layout: Layout, arg: str = "layout") -> None:
    """``layout`` asks for tp > 1 but the model has no (supported) tensor-parallel plan."""
    if layout.tp_enabled and (why := tp_plan_error(model)) is not None:
        raise ValueError(f"`{arg}` has tp={layout.tp}, but {why}")


def _name_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((n for n, m in model.named_modules() if m is target), None)


def decoder_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each decoder block, in order; a block inside a checkpoint wrapper is
    given as its wrapper. Blocks: classes named in ``_no_split_modules``, else ``model.model.layers``."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(u + ".") for u, _ in units):
            continue
        if type(getattr(module, "_checkpoint_wrapped_module", module)).__name__ in classes:
            units.append((name, module))
    if units:
        return units
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]
    raise TypeError(
        f"cannot find the decoder blocks of {type(model).__name__}: none of its modules is of a class "
        f"in `_no_split_modules` ({sorted(classes)}) and it has no `model.layers`"
    )


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron TP over ``tp_mesh`` (1-D) from the model's own plan. Activations stay replicated
    between blocks (no sequence parallel), so the HF code in between (norms, rotary, residuals)
    runs on plain local tensors."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if (why := tp_plan_error(model)) is not None:
        raise ValueError(why)
    base = _name_of(model, getattr(model, "base_model", model)) or ""
    prefix = f"{base}." if base else ""
    parallelize_module(
        model, tp_mesh, {prefix + k: _style(v) for k, v in base_tp_plan(model).items()}
    )
    embed = _name_of(model, model.get_input_embeddings())
    head = _name_of(model, model.get_output_embeddings())
    tied = (
        head is not None
        and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    # Both plans shard the [vocab, hidden] weight on dim 0 (vocab), so a tied weight gets the same
    # placement from either side and can be re-tied after distribution.
    outer = {embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if head is not None:
        outer[head] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, tp_mesh, outer)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight

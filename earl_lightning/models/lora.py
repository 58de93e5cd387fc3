"""LoRA adapters on a causal LM (``peft``), and the merged weights that stand for them.

:class:`LoraSettings` is the ``--model.peft`` group. :func:`apply_lora` injects the adapters into
the HF model in place (``peft.inject_adapter_in_model``): the model keeps its class and its
``model.layers`` (so FSDP, activation checkpointing and the scored last layer find them), each
targeted ``nn.Linear`` becomes a ``peft`` LoRA layer holding the frozen ``base_layer`` and the
trainable ``lora_A`` / ``lora_B``, and only those adapter weights require gradients.

:func:`adapters_disabled` runs the base model itself (the KL reference: no second copy), and
:func:`merged_tensors` turns a stream of ``(name, tensor)`` pairs of the adapted model into the
plain model's weights, ``W + B @ A * scale`` under the base names: what a generation engine
receives and what an export writes. Only settings that keep both facts true are accepted (no
DoRA, no weight-changing initialisations, no trainable biases or whole modules).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from earl_lightning.core.checks import check_count, check_number

ARG = "--model.peft"
ADAPTER = "default"
# Further peft.LoraConfig settings that keep "adapter disabled == the base model" and
# "merged weight == W + B @ A * scale" true.
EXTRA_KWARGS = (
    "use_rslora",
    "fan_in_fan_out",
    "init_lora_weights",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "exclude_modules",
)
_INITS = (
    True,
    False,
    "gaussian",
)  # the others (pissa, olora, loftq, eva, corda...) rewrite the base weights
_PARTS = ("base_layer.weight", f"lora_A.{ADAPTER}.weight", f"lora_B.{ADAPTER}.weight")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters on the policy (``peft``); the base weights stay frozen.

    Args:
        r: rank of each adapter.
        alpha: the adapter's output is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with
            ``kwargs: {use_rslora: true}``).
        dropout: dropout on each adapter's input while training.
        target_modules: ``all-linear`` (every linear layer except the LM head), a list of module
            names (``[q_proj, v_proj]``) or a regular expression over module paths.
        kwargs: further ``peft.LoraConfig`` settings, among ``use_rslora``, ``fan_in_fan_out``,
            ``init_lora_weights`` (true, false or gaussian), ``layers_to_transform``,
            ``layers_pattern``, ``rank_pattern``, ``alpha_pattern`` and ``exclude_modules``.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_count(f"{ARG}.r", self.r, unit=" (the adapters' rank)")
        check_number(f"{ARG}.alpha", self.alpha, low=0, strict=True)
        check_number(f"{ARG}.dropout", self.dropout, low=0, high=1, strict_high=True)
        t = self.target_modules
        if not (isinstance(t, str) and t) and not (
            isinstance(t, (list, tuple)) and t and all(isinstance(n, str) and n for n in t)
        ):
            raise ValueError(
                f"`{ARG}.target_modules` must be 'all-linear', a non-empty list of module names or a "
                f"regular expression, got {t!r}"
            )
        if not isinstance(self.kwargs, dict):
            raise ValueError(
                f"`{ARG}.kwargs` must be a mapping of peft.LoraConfig settings, got {self.kwargs!r}"
            )
        bad = sorted(set(self.kwargs) - set(EXTRA_KWARGS))
        if bad:
            raise ValueError(
                f"`{ARG}.kwargs` sets {bad}, which is not supported; supported: {list(EXTRA_KWARGS)} "
                f"(r, alpha, dropout and target_modules have their own settings; the others change "
                f"the base weights or what a merged weight is)"
            )
        init = self.kwargs.get("init_lora_weights", True)
        if init not in _INITS or not isinstance(init, (bool, str)):
            raise ValueError(
                f"`{ARG}.kwargs.init_lora_weights` must be true, false or 'gaussian', got {init!r} "
                f"(the other initialisations rewrite the base weights, which are the KL reference)"
            )
        self.peft_config()  # peft's own checks, now, at config time

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` these settings stand for."""
        peft = import_peft()
        try:
            return peft.LoraConfig(
                r=self.r,
                lora_alpha=self.alpha,
                lora_dropout=self.dropout,
                bias="none",
                target_modules=_targets(self.target_modules),
                **self.kwargs,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"`{ARG}`: peft rejects these settings: {err}") from None


def _targets(value: str | list[str]) -> str | list[str]:
    return value if isinstance(value, str) else list(value)


def import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError(
            f"`{ARG}` needs peft, which is not installed; install it with: pip install 'peft>=0.13'"
        ) from None
    return peft


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject ``settings``' adapters into ``model`` in place (base weights frozen) and return it."""
    peft = import_peft()
    names = linear_names(model)
    try:
        peft.inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    except ValueError as err:
        if "not found" not in str(err) and "did not match" not in str(err):
            raise
        raise ValueError(
            f"`{ARG}.target_modules` {settings.target_modules!r} matches no module of "
            f"{type(model).__name__}; its linear layers are named {', '.join(names)} (a list of "
            f"these, a regular expression over module paths, or 'all-linear')"
        ) from None
    from peft.tuners.lora import Linear

    for name, layer in lora_layers(model).items():
        if not isinstance(layer, Linear):
            raise ValueError(
                f"`{ARG}.target_modules` {settings.target_modules!r} selects {name!r} "
                f"({type(layer.get_base_layer()).__name__}); LoRA here covers linear layers only"
            )
    return model


def linear_names(model: torch.nn.Module) -> list[str]:
    """The names ``target_modules`` can list: the last part of every linear layer's path (the
    output layer aside, as ``all-linear`` leaves it)."""
    head = model.get_output_embeddings()  # a HF causal LM
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head
        }
    )


def check_targets(settings: LoraSettings, name_or_path: str, arg: str = "--model.model") -> None:
    """Inject ``settings``' adapters into ``name_or_path``'s architecture built on the meta device
    (no weights read, nothing allocated): a ``target_modules`` that matches nothing, or matches
    something other than a linear layer, is refused while the run is being built rather than
    once every process has loaded the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from earl_lightning.models.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path, arg))
    with torch.device("meta"):
        apply_lora(AutoModelForCausalLM.from_config(config), settings)


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """``model``'s LoRA layers by module path (none when peft was never imported)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    return bool(lora_layers(model))


def copy_lora(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Inject into ``dst`` (the same architecture, e.g. a replica built on the meta device) the
    adapters ``src`` carries, under the same names; the weights are left to the caller's copy."""
    if not has_lora(src):
        return
    import peft

    peft.inject_adapter_in_model(src.peft_config[ADAPTER], dst, adapter_name=ADAPTER)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` as its base model (every adapter bypassed), then adapted again.

    The flag is set directly: peft's ``enable_adapters`` also flips the adapters' ``requires_grad``
    (False, then True for all), which would change what the optimizer trains."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False


@dataclass(frozen=True)
class Merge:
    """How one LoRA layer's pieces make its plain weight."""

    scaling: float
    fan_in_fan_out: bool


def merge_plan(model: torch.nn.Module, name_of: Callable[[str], str] = str) -> dict[str, Merge]:
    """``{module name (as ``name_of`` writes it): Merge}`` for every LoRA layer of ``model``."""
    return {
        name_of(n): Merge(float(m.scaling[ADAPTER]), bool(m.fan_in_fan_out))
        for n, m in lora_layers(model).items()
    }


def merged_tensors(
    named: Iterable[tuple[str, torch.Tensor]], plan: dict[str, Merge]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's ``(name, tensor)`` pairs from the adapted model's: each LoRA layer's
    ``base_layer.weight``, ``lora_A`` and ``lora_B`` become one ``weight = W + B @ A * scale``
    (computed in float32, returned in W's dtype), ``base_layer.bias`` becomes ``bias``; the rest
    passes through. A layer's pieces may arrive apart (other tensors in between)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        prefix, part = _split(name, plan)
        if prefix is None:
            yield name, t
        elif part == "base_layer.bias":
            yield f"{prefix}.bias", t
        else:
            got = pending.setdefault(prefix, {})
            got[part] = t
            if len(got) == len(_PARTS):
                del pending[prefix]
                yield f"{prefix}.weight", merge_weight(*(got[p] for p in _PARTS), plan[prefix])
    if pending:
        raise ValueError(
            f"LoRA layers {sorted(pending)} lack some of {list(_PARTS)} in the weights given"
        )


def _split(name: str, plan: dict[str, Merge]) -> tuple[str | None, str]:
    for part in (*_PARTS, "base_layer.bias"):
        if name.endswith("." + part) and name[: -len(part) - 1] in plan:
            return name[: -len(part) - 1], part
    return None, ""


def merge_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, merge: Merge
) -> torch.Tensor:
    """``weight`` [out, in] + ``lora_b`` [out, r] @ ``lora_a`` [r, in] * scaling (transposed for
    ``fan_in_fan_out`` weights, stored [in, out])."""
    delta = (lora_b.float() @ lora_a.float()) * merge.scaling  # [out, in]
    if merge.fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)

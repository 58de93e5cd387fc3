"""The Llama-pattern RMSNorm with its backward written out, for the train forward in fp32.

transformers' RMSNorm (Llama, Mistral, Qwen2, Qwen3: ``weight * (x * rsqrt(mean(x²) + eps))``)
is a chain of elementwise operators, and autograd's backward of the chain walks every one of them
back: on the ten-turn benchmark's 64 × 650 × 128 activations about ten passes over memory, with the
weight's gradient reduced over a broadcast. Written out, the backward is

    x̂ = x · r,  r = rsqrt(mean(x²) + eps)
    ∂weight = Σ g · x̂ over every position
    ∂x = r · (g·w − x̂ · mean(g·w · x̂))

which reads the saved input and ``r`` once more and takes 0.5–0.7 of the time
(``benchmarks/train_cpu_paths.py``). The forward is the module's own operators in its order, so
the outputs are the module's bit for bit; the gradients equal autograd's up to float rounding.

:func:`rms_norm_backward` puts it on a model's RMSNorms for a block, on the modules themselves
(their hooks still run). It applies to fp32 inputs and weights only (the module computes in fp32
and casts back, which the written-out backward does not follow), not to distributed tensors (a
tensor-parallel model's norms: left to autograd; under FSDP2 the gathered weight is a plain tensor
while the layer runs), only where gradients are recorded, and not in a model whose layers
recompute their forward in the backward (activation checkpointing).

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from earl_lightning.parallel.parallelize import recomputes_activations

# the classes whose forward is exactly the formula above (checked by tests against the modules)
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # noqa: D102
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return weight * (x * r)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # noqa: D102
        x, r, weight = ctx.saved_tensors
        normed = x * r
        grad_weight = (grad * normed).reshape(-1, normed.shape[-1]).sum(0)
        grad_normed = grad * weight
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        return (grad_normed - normed * dot).mul_(r), grad_weight, None


def rms_norm(module: nn.Module, hidden_states: Tensor) -> Tensor:
    """``module``'s RMSNorm of ``hidden_states`` through the written-out backward where it applies
    (fp32, gradients recorded), else the module's own forward."""
    weight = module.weight
    if (
        hidden_states.dtype == torch.float32
        and weight.dtype == torch.float32
        and torch.is_grad_enabled()
        and (hidden_states.requires_grad or weight.requires_grad)
        and not isinstance(hidden_states, DTensor)
        and not isinstance(weight, DTensor)
    ):
        return _RMSNorm.apply(hidden_states, weight, module.variance_epsilon)
    return type(module).forward(module, hidden_states)


def _norms(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if type(m).__name__ in RMS_NORMS
        and isinstance(getattr(m, "weight", None), Tensor)
        and hasattr(m, "variance_epsilon")
        and "forward" not in vars(m)  # a forward already replaced on the module is kept
    ]


@contextmanager
def rms_norm_backward(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, ``model``'s Llama-pattern RMSNorms run :func:`rms_norm`; nothing changes
    with ``enabled=False``, where no gradients are recorded (a no-grad forward, e.g. the experience
    stage's: :func:`rms_norm` would only hand each call back to the module), or for a model whose
    layers recompute their forward in the backward (the recomputation, outside the block, would
    save other tensors)."""
    apply = enabled and torch.is_grad_enabled() and not recomputes_activations(model)
    norms = _norms(model) if apply else []
    for m in norms:
        m.forward = rms_norm.__get__(m)  # bound: module(x) -> rms_norm(module, x)
    try:
        yield
    finally:
        for m in norms:
            del m.forward

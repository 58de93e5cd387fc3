"""The train forward's elementwise work fused by ``torch.compile``, on CPU.

On CPU the large activations of a train forward do not stay in cache, and each elementwise
operator is a pass over memory: the MLP's ``silu(gate) * up`` is two passes forward and three
backward over the ``[tokens, intermediate]`` activations, an RMSNorm about six, the rotary
embedding of the queries and keys five each way. Compiled by inductor, each is one loop forward
and one backward (``benchmarks/train_cpu_paths.py`` times the ten-turn benchmark's train pass
beside the eager one). This is verl's habit (``use_torch_compile`` compiles hot functions, not the
model): the functions below are compiled, with dynamic shapes, and the modules stay as they are.

:func:`fused_elementwise` puts them, for a block, on a model's Llama-pattern MLPs
(``down(silu(gate(x)) * up(x))``) and RMSNorms (``weight * (x * rsqrt(mean(x²) + eps))``), on the
modules themselves (hooks still run; a LoRA projection is still the adapter's), and on the rotary
embedding its attention layers take from their modeling module (``apply_rotary_pos_emb``, through
a dispatcher put on that module once, which hands every call outside such a block to the
original). A call takes a compiled kernel where its input holds at least :data:`MIN_ELEMENTS`
values (smaller ones run from cache anyway, and a compiled call's guards cost more than it
saves), is an fp32 CPU tensor, not a distributed tensor, and gradients are recorded; else the
forward it had (the written-out RMSNorm of :mod:`earl_lightning.train.rms_norm` where that is on).
The outputs are the eager ones up to float rounding (the norm's mean is reduced in another order;
the MLP's product and the rotation come out bit for bit here), the gradients likewise.

The kernels are compiled once per process, at the first forward that takes them (seconds; inductor
keeps them on disk for the next process), and tried against the eager functions first: where
compiling fails (no C++ compiler) or disagrees, a warning says so and the forward runs eagerly.
Not for a model whose layers recompute their forward in the backward (activation checkpointing),
nor on GPU (not measured there).

No Lightning here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from earl_lightning.core import console
from earl_lightning.models.llama_layers import text_config
from earl_lightning.parallel.parallelize import recomputes_activations
from earl_lightning.train.rms_norm import RMS_NORMS

# the classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (tests check each)
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
# their ``act_fn`` for ``hidden_act: silu``: torch's module or transformers' (``F.silu`` both)
SILUS = ("SiLU", "SiLUActivation")
# the modeling modules whose apply_rotary_pos_emb is :func:`rope` (tests check each)
ROPE_MODULES = tuple(
    f"transformers.models.{t}.modeling_{t}" for t in ("llama", "mistral", "qwen2", "qwen3")
)
# a call's input from this many values takes the compiled kernel (64 x 650 x 128 is 5.3M)
MIN_ELEMENTS = 1 << 20

# inside a fused_elementwise block: the model's hidden and head sizes (what the kernels are first
# compiled for), for the calls there (the modules' and the rotary dispatchers'); None outside
_BLOCK: ContextVar[tuple[int, int] | None] = ContextVar("earl_fused_block", default=None)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, the Llama-pattern MLP's elementwise part."""
    return F.silu(gate) * up


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The Llama-pattern RMSNorm of fp32 ``x``: ``weight * (x * rsqrt(mean(x²) + eps))``."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotary embedding of ``q`` and ``k`` [B, H, T, D] with ``cos`` and ``sin`` [B, T, D]:
    transformers' ``apply_rotary_pos_emb`` of these models (``unsqueeze_dim=1``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class _Kernels:
    """The compiled :func:`swiglu`, :func:`rms_norm` and :func:`rope` of this process."""

    def __init__(self) -> None:
        self.tried = False
        self.swiglu: Callable | None = None
        self.rms_norm: Callable | None = None
        self.rope: Callable | None = None

    def get(self, width: int, head_dim: int) -> _Kernels | None:
        """The kernels (None: not available), compiled and checked at the first call;
        ``width`` and ``head_dim``, the model's hidden and head sizes, shape the checks' inputs
        (inductor specialises some sizes on what it first sees)."""
        if not self.tried:
            self.tried = True
            self._compile(width, head_dim)
        return self if self.swiglu is not None else None

    @property
    def failed(self) -> bool:
        """Compiling was tried and did not give the kernels."""
        return self.tried and self.swiglu is None

    def _compile(self, width: int, head_dim: int) -> None:
        console.info(
            "optim.fused_elementwise: compiling the MLP, RMSNorm and rotary kernels for the train "
            "forward (once per process; inductor keeps them on disk for the next)"
        )
        start = time.perf_counter()
        try:
            kernels = [torch.compile(f, dynamic=True) for f in (swiglu, rms_norm, rope)]
            for compiled, (eager, args, extra) in zip(kernels, _checks(width, head_dim)):
                _check(compiled, eager, args, extra)
        except Exception as err:  # noqa: BLE001 - any failure: the eager forward runs
            console.warn(
                "optim.fused_elementwise: torch.compile could not build the fused kernels "
                f"({type(err).__name__}: {str(err)[:300]}); the train forward runs eagerly. "
                "Set optim.fused_elementwise: false to skip the attempt."
            )
            return
        self.swiglu, self.rms_norm, self.rope = kernels
        console.info(
            "optim.fused_elementwise: compiled the kernels in "
            f"{time.perf_counter() - start:.1f} s (once per process)"
        )


def _checks(width: int, head_dim: int) -> list[tuple[Callable, list[Tensor], tuple]]:
    """Each kernel's eager function and the inputs it is tried on: as many values as the smallest
    call it takes, laid out as the models' are (the norm's weight a parameter, the queries and
    keys transposed views), so that the train forward's calls reuse what is compiled here."""
    gen = torch.Generator().manual_seed(0)
    width, head_dim = max(width, 2), max(head_dim - head_dim % 2, 2)
    rows = max(MIN_ELEMENTS // (2 * width) + 1, 2)
    x = [torch.randn(2, rows, width, generator=gen, requires_grad=True) for _ in range(2)]
    weight = nn.Parameter(torch.randn(width, generator=gen))
    # 3 rows of 4 query and 2 key heads, a table of one row as the train forward's (no position
    # ids), two tensors (not views of one): torch.compile guards on sizes that coincide, on views
    rows = max(MIN_ELEMENTS // (12 * head_dim) + 1, 2)
    q, k = (  # views of a linear layer's 2-D output, as the attention layers make them
        torch.randn(3 * rows, heads * head_dim, generator=gen, requires_grad=True)
        .view(3, rows, heads, head_dim)
        .transpose(1, 2)
        for heads in (4, 2)
    )
    cos, sin = (torch.randn(1, rows, head_dim, generator=gen) for _ in range(2))
    return [(swiglu, x, ()), (rms_norm, [x[0], weight], (1e-6,)), (rope, [q, k], (cos, sin))]


def _check(compiled: Callable, eager: Callable, args: list[Tensor], extra: tuple) -> None:
    """Run ``compiled`` and ``eager`` forward and backward on ``args`` (``extra``: inputs that take
    no gradient) and raise where they differ."""
    gen = torch.Generator().manual_seed(1)
    got_out, want_out = (_tuple(f(*args, *extra)) for f in (compiled, eager))
    grads = [torch.randn(o.shape, generator=gen) for o in want_out]
    got = torch.autograd.grad(got_out, args, grads)
    want = torch.autograd.grad(want_out, args, grads)
    for g, w in zip(got, want):  # a weight's gradient sums thousands of rows in another order
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))


def _tuple(out: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


KERNELS = _Kernels()


def _kernels(x: Tensor, *params: Tensor) -> _Kernels | None:
    """The kernels for a call with input ``x`` and parameters ``params`` inside a block, where it
    qualifies; the first such call of the process compiles them (a call that does not qualify
    never does: small runs compile nothing)."""
    sizes = _BLOCK.get()
    return KERNELS.get(*sizes) if sizes is not None and _takes(x, *params) else None


def _takes(x: Tensor, *params: Tensor) -> bool:
    """Whether a call with input ``x`` and parameters ``params`` takes a compiled kernel."""
    return (
        torch.is_grad_enabled()
        and x.numel() >= MIN_ELEMENTS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not isinstance(x, DTensor)
        and all(p.dtype == torch.float32 and not isinstance(p, DTensor) for p in params)
    )


def _fused_mlp(module: nn.Module, before: Callable, x: Tensor) -> Tensor:
    kernels = _kernels(x)
    if kernels is None:
        return before(x)
    gate, up = module.gate_proj(x), module.up_proj(x)
    if isinstance(gate, DTensor) or isinstance(up, DTensor):  # tensor-parallel projections
        return module.down_proj(module.act_fn(gate) * up)  # the module's own forward
    return module.down_proj(kernels.swiglu(gate, up))


def _fused_norm(module: nn.Module, before: Callable, x: Tensor) -> Tensor:
    weight = module.weight
    kernels = _kernels(x, weight) if x.requires_grad or weight.requires_grad else None
    if kernels is None:
        return before(x)
    return kernels.rms_norm(x, weight, module.variance_epsilon)


def _rope_dispatcher(original: Callable) -> Callable:
    """``apply_rotary_pos_emb`` for a modeling module: the compiled :func:`rope` inside a
    :func:`fused_elementwise` block where the call qualifies, else ``original``."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if torch.compiler.is_compiling():  # inside a model compiled whole: transformers' own
            return original(q, k, cos, sin, *args, **kwargs)
        plain = (
            not args and set(kwargs) <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1
        )
        if plain and (q.requires_grad or k.requires_grad):
            kernels = _kernels(q, k, cos, sin)
            if kernels is not None:
                return kernels.rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    apply_rotary_pos_emb.earl_dispatcher = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _install_rope(model: nn.Module) -> None:
    """Put the dispatcher (once) on each modeling module of :data:`ROPE_MODULES` that ``model``'s
    layers come from, where its ``apply_rotary_pos_emb`` is still transformers' own (another
    library's replacement is kept, and its calls never reach a dispatcher)."""
    for name in {type(m).__module__ for m in model.modules()} & set(ROPE_MODULES):
        module = sys.modules[name]
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if getattr(fn, "__module__", None) == name and not getattr(fn, "earl_dispatcher", False):
            module.apply_rotary_pos_emb = _rope_dispatcher(fn)


def _targets(model: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """The model's Llama-pattern MLPs (SiLU) and RMSNorms, each with its fused forward."""
    out: list[tuple[nn.Module, Callable]] = []
    for m in model.modules():
        name = type(m).__name__
        if name in MLPS and type(getattr(m, "act_fn", None)).__name__ in SILUS:
            out.append((m, _fused_mlp))
        elif name in RMS_NORMS and hasattr(m, "variance_epsilon"):
            out.append((m, _fused_norm))
    return out


def _sizes(model: nn.Module) -> tuple[int, int]:
    """The model's hidden size and head size (16 and 8 where its config does not say)."""
    config = text_config(model)
    width = int(getattr(config, "hidden_size", 16))
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or (width // heads if heads else 8)
    return width, int(head_dim)


def _on_cpu(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu"


@contextmanager
def fused_elementwise(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, ``model``'s Llama-pattern MLPs, RMSNorms and rotary embeddings take the
    compiled kernels where a call qualifies (see the module's doc; the first such call of the
    process compiles them); nothing changes with ``enabled=False``, where no gradients are
    recorded, off CPU, for a model whose layers recompute their forward in the backward, or where
    the kernels could not be compiled. Enter it inside
    :func:`~earl_lightning.train.rms_norm.rms_norm_backward`: a call the kernels do not take runs
    the forward the module had on entry."""
    apply = (
        enabled and torch.is_grad_enabled() and _on_cpu(model) and not recomputes_activations(model)
    )
    targets = _targets(model) if apply and not KERNELS.failed else []
    if targets:
        _install_rope(model)
    saved = []
    for m, fused in targets:
        saved.append((m, vars(m).get("forward")))  # a forward put on the instance, if any
        m.forward = _bind(fused, m, m.forward)
    token = _BLOCK.set(_sizes(model) if targets else None)
    try:
        yield
    finally:
        _BLOCK.reset(token)
        for m, own in saved:
            if own is None:
                del m.forward
            else:
                m.forward = own


def _bind(fused: Callable, module: nn.Module, before: Callable) -> Callable:
    """``forward(x)``: ``fused(module, before, x)``."""

    def forward(x: Tensor) -> Tensor:
        return fused(module, before, x)

    return forward

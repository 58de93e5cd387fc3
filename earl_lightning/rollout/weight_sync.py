"""Push the training copy's weights into a generation engine, and check that it worked.

The training copy may be plain tensors or DTensors (FSDP2 ``fully_shard`` over dp, TP over tp).
:func:`stream_full_weights` walks the parameters in a fixed order, groups them into buckets of
about ``bucket_bytes`` and materializes one bucket at a time (``DTensor.full_tensor()`` is a
collective, so every rank walks the same order and takes part), yielding ``(hf_name, tensor)``
pairs. The engine consumes that generator lazily, so at most one bucket of full tensors exists
beyond the shards. A model with LoRA adapters streams its merged weights, ``W + B @ A * scale``
under the base names (:func:`~earl_lightning.models.lora.merged_tensors`): the engine runs the
plain architecture.

:func:`logprob_mismatch` compares the log-probs the engine reported for its sampled tokens with
the trainer's recomputation on the same tokens: after a correct sync they agree to float noise;
stale or mis-mapped weights show up as a large value. It is free: the trainer computes the old
log-probs anyway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from earl_lightning.core import console
from earl_lightning.core.checks import check_count
from earl_lightning.models.lora import merge_plan, merged_tensors

# Wrappers that insert a path component without changing the HF layout.
_WRAPPER_PREFIXES = (
    "_orig_mod.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "module.",
)

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_MISMATCH_THRESHOLD = 1e-2


def hf_parameter_name(name: str) -> str:
    """The checkpoint name of a parameter, with torch.compile / checkpoint / DDP wrappers removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: DTensors are all-gathered (a collective), others detached."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach()
    return t.detach()


def weight_buckets(
    model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """Parameters in ``named_parameters`` order (tied weights once), grouped so that each bucket's
    full (unsharded) size is at most ``bucket_bytes`` unless one tensor alone is larger."""
    check_count("bucket_bytes", bucket_bytes)
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()  # numel() of a DTensor is the global one
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((hf_parameter_name(name), p))
        size += nbytes
    return [b for b in buckets if b]


def stream_full_weights(
    model: torch.nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` bucket by bucket; the previous bucket is released before
    the next is gathered (a LoRA layer's base weight is held until its adapters arrive). Every
    rank must consume the whole generator."""
    for name, t in merged_tensors(
        _full_buckets(model, bucket_bytes), merge_plan(model, hf_parameter_name)
    ):
        yield name, (t if dtype is None else t.to(dtype))


def _full_buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in weight_buckets(model, bucket_bytes):
        with torch.no_grad():
            full = [(name, full_tensor(p)) for name, p in bucket]
        yield from full
        del full


@dataclass
class SyncReport:
    num_tensors: int
    num_bytes: int
    seconds: float


def sync_weights(
    model: torch.nn.Module,
    backend: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> SyncReport:
    """Stream ``model``'s weights into ``backend.update_weights`` (which also resets its prefix
    cache). Call on every rank after the optimizer step and before the next rollout."""
    t0 = time.perf_counter()
    total = {"bytes": 0}

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in stream_full_weights(model, bucket_bytes, dtype):
            total["bytes"] += t.numel() * t.element_size()
            yield name, t

    n = backend.update_weights(counted())
    return SyncReport(num_tensors=n, num_bytes=total["bytes"], seconds=time.perf_counter() - t0)


def logprob_mismatch(
    rollout_logprobs: torch.Tensor, recomputed_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Max absolute difference over generated tokens (``mask`` 1); 0.0 when none.

    Args:
        rollout_logprobs: [...] log-probs the engine reported for its sampled tokens.
        recomputed_logprobs: [...] the trainer's log-probs of the same tokens (same temperature).
        mask: [...] 1 where the token was generated.

    Returns:
        [] float32 scalar (local; all-reduce with MAX for a global figure).
    """
    if rollout_logprobs.shape != recomputed_logprobs.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(
            f"`rollout_logprobs` {tuple(rollout_logprobs.shape)}, `recomputed_logprobs` "
            f"{tuple(recomputed_logprobs.shape)} and `mask` {tuple(mask.shape)} must have the same shape"
        )
    diff = (rollout_logprobs.float() - recomputed_logprobs.float()).abs()  # [...]
    diff = torch.where(mask.bool(), diff, torch.zeros_like(diff))
    return diff.max() if diff.numel() else torch.zeros((), dtype=torch.float32)


def step_mismatch(
    tokens: dict[str, torch.Tensor], reduce: Any, measured: float | None, threshold: float
) -> float:
    """An RL step's ``logprob/mismatch``: the max |rollout - recomputed| log-prob over the generated
    tokens of every rank, from the batch's ``tokens`` (``rollout_logprobs``, ``old_logprobs``,
    ``action_mask``, each [N]) and ``reduce`` (the stage's Reducer, a collective), or the value
    an on-policy update ``measured`` on its own forward (already global); warns over
    ``threshold``."""
    if measured is None:
        local = logprob_mismatch(
            tokens["rollout_logprobs"], tokens["old_logprobs"], tokens["action_mask"]
        )
        measured = float(reduce.max(local))
    check_logprob_mismatch(measured, threshold)
    return measured


def check_logprob_mismatch(
    value: float | torch.Tensor,
    threshold: float = DEFAULT_MISMATCH_THRESHOLD,
    where: str = "rollout",
) -> bool:
    """Warn loudly when the mismatch exceeds ``threshold``; returns True when it does."""
    v = float(value)
    if v > threshold:
        console.warn(
            f"!!! {where}: log-probs of the generation engine differ from the trainer's recomputation by up to "
            f"{v:.3g} (> {threshold:g}). The engine is likely generating with stale or mis-mapped weights "
            f"(weight sync skipped or failed), or with a different dtype / temperature. PPO ratios and KL are "
            f"off-policy by that much."
        )
        return True
    return False

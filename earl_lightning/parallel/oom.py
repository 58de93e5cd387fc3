"""Recognizing out-of-memory errors of every kind a stage can raise (no Lightning here)."""

from __future__ import annotations

import torch

# Messages of allocation failures that do not have a type of their own.
_CPU_OOM = (
    "DefaultCPUAllocator: can't allocate memory",
    "not enough memory",
    "Cannot allocate memory",
)
_VLLM_OOM = (
    "No available memory for the cache blocks",
    "KV cache is needed, which is larger than the available",
    "larger than the available KV cache memory",
)


def is_oom_error(err: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (GPU), ``MemoryError`` and CPU allocator failures, and
    a vLLM engine that cannot fit its KV cache."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, (RuntimeError, ValueError)) and any(
        m in text for m in _CPU_OOM + _VLLM_OOM
    )

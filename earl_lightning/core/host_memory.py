"""Host (CPU) memory of a training process: keep freed blocks for the next step.

glibc's malloc serves a block above its mmap threshold (128 KiB, rising with use to at most
32 MiB) with a fresh ``mmap`` and unmaps it on ``free``. A train step's activations are mostly such
blocks: they are unmapped when the step ends and mapped again, zero-filled one page fault at a
time, by the next step. On the multi-turn train pass of ``benchmarks/train_roofline.py`` (64
episodes of 650 tokens, 2 cores) that re-mapping was three quarters of the time
(``docs/benchmarks.md#host-memory-kept-between-steps``). ``retain`` asks glibc to take
every block from its heap (``M_MMAP_MAX`` 0) and never to give the heap's free top back
(``M_TRIM_THRESHOLD`` at its maximum), so freed activations are reused as they are, as a device
caching allocator does. The price: resident memory stays at the run's high-water mark.

``EARL_HOST_MEMORY`` (``retain``, the default, or ``glibc``: leave malloc as it is) chooses for
the process; :class:`~earl_lightning.modules.AgenticRLModule` and the warm-start module apply it
when set up. :func:`release_host_memory` undoes ``retain``: it pins the thresholds at glibc's
starting values (128 KiB, without glibc's growth of them) and trims at once, so that resident
memory follows live memory. Where the C library is not glibc nothing is changed.

Sits below every layer: it imports nothing from the project.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ENV = "EARL_HOST_MEMORY"
MODES = ("retain", "glibc")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc <malloc.h>
_INT_MAX = 2**31 - 1
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}
_RETAIN = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: _INT_MAX}
# The same settings as glibc's environment variables, read when a process starts (for a process
# earl does not set up itself, e.g. the other side of benchmarks/vs_trl.py).
RETAIN_ENV = {
    "MALLOC_MMAP_MAX_": str(_RETAIN[_M_MMAP_MAX]),
    "MALLOC_TRIM_THRESHOLD_": str(_RETAIN[_M_TRIM_THRESHOLD]),
}
MALLOC_ENV = (*RETAIN_ENV, "MALLOC_MMAP_THRESHOLD_")


def host_memory_mode(value: str | None = None) -> str:
    """The mode ``value`` names, or ``EARL_HOST_MEMORY``'s (default ``retain``); a clear error else."""
    raw = os.environ.get(ENV, "retain") if value is None else value
    mode = raw.strip().lower()
    if mode not in MODES:
        raise ValueError(f"`{ENV}` must be one of {', '.join(MODES)}, got {raw!r}")
    return mode


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _ = libc.gnu_get_libc_version  # only glibc has it (musl, macOS: nothing to tune)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def apply_host_memory(mode: str | None = None) -> bool:
    """Set glibc's malloc for ``mode`` (default: ``EARL_HOST_MEMORY``'s); True where it was changed.

    Process-wide and idempotent; blocks allocated before keep their kind (a mapped block is still
    unmapped when freed)."""
    libc = _glibc()
    if host_memory_mode(mode) == "glibc" or libc is None:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in _RETAIN.items())


def release_host_memory() -> bool:
    """Undo ``retain``: large blocks mapped and unmapped again, the heap trimmed as it frees."""
    libc = _glibc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in _GLIBC_DEFAULTS.items())
    libc.malloc_trim(0)
    return ok


def trim_host_memory() -> None:
    """Give the heap's free memory back to the OS now (after a failed attempt), whatever the mode."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)

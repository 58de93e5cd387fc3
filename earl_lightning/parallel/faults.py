"""Recognizing a lost peer: a collective that failed because another rank died or stopped answering
(no Lightning here)."""

from __future__ import annotations

import torch.distributed as dist

# What gloo and the TCP store say when the other end of a collective is gone or silent.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out", "timed out",
              "Socket Timeout", "NCCL communicator was aborted", "ProcessGroupNCCL's watchdog")


def is_peer_failure(err: BaseException) -> bool:
    """True for a distributed-backend error (NCCL, timeouts) or a transport error of gloo."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _PEER_LOST)

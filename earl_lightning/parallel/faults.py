"""A lost peer: a collective that failed because another rank died or stopped answering, and the
one-line :class:`~earl_lightning.core.errors.RankFailure` a run ends with then (no Lightning here).

:func:`peer_failure` recognizes the errors torch.distributed raises for it, and only those: an
error that merely says "timed out" (an environment's own timeout re-raised as a RuntimeError) is
not a lost peer. :class:`LostPeer` turns one raised inside ``with lost.during(where):`` into the
one line naming the rank, the step, where it happened and the checkpoint to resume from.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from earl_lightning.core.errors import RankFailure

PeerFailure = Literal["died", "silent"]

# gloo raises plain RuntimeErrors whose text starts with the transport's source location, e.g.
# "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17644: Connection reset by peer" (the
# peer was killed) or "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv
# operation to complete" (the peer is alive but silent past the process group's timeout); texts
# produced with torch 2.13 in tests/unit/test_peer_faults.py.
_GLOO = re.compile(r"gloo/transport/[\w/]+\.cc:\d+\]")
_GLOO_SILENT = re.compile(r"Timed out waiting \d+ms for (recv|send) operation|Connection timed out")
_GLOO_DIED = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused")
# NCCL's errors are DistBackendErrors; only these say that a peer is gone or a collective timed
# out (others, e.g. "invalid usage", are bugs to see in full): ncclRemoteError's text, and the
# watchdog's on a timeout and on the communicator it then aborts.
_NCCL_DIED = ("remote process exited or there was a network error",)
_NCCL_SILENT = (
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
    "Some NCCL operations have failed or timed out",
)


def peer_failure(err: BaseException) -> PeerFailure | None:
    """``"died"`` when ``err`` is a collective's error because a peer process is gone, ``"silent"``
    when a peer did not answer within the process group's timeout, else None.

    gloo's transport errors are recognized by their origin and text; a ``DistNetworkError`` or
    ``DistStoreError`` (the rendezvous store unreachable or a key never set) is a lost peer by its
    type; a ``DistBackendError`` (NCCL) only with one of NCCL's peer-lost texts."""
    text = str(err)
    if isinstance(err, (dist.DistNetworkError, dist.DistStoreError)):
        return "silent" if "timeout" in text.lower() else "died"
    if not isinstance(err, RuntimeError):
        return None
    if isinstance(err, dist.DistBackendError) and any(m in text for m in _NCCL_DIED):
        return "died"
    if isinstance(err, dist.DistBackendError) and any(m in text for m in _NCCL_SILENT):
        return "silent"
    if not _GLOO.search(text):
        return None
    if _GLOO_SILENT.search(text):
        return "silent"
    return "died" if _GLOO_DIED.search(text) else None


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective's error because a peer rank died or stopped answering."""
    return peer_failure(err) is not None


@dataclass(frozen=True)
class RunFacts:
    """What the one line names: this rank, the step, the checkpoint to resume from ("" when none
    was saved yet), and the directory the transport's traceback is written to."""

    rank: int
    step: str  # "RL step 3", "global step 4"
    last_checkpoint: str
    log_dir: str


def _what_happened(err: BaseException) -> str:
    """The lost peer ``err`` reports, as the one lines say it: the cause and the error's first line."""
    cause = (
        "another process stopped answering (no reply within the collective timeout)"
        if peer_failure(err) == "silent"
        else "another process died"
    )
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{cause} ({type(err).__name__}: {first[:160]})"


def lost_peer_line(err: BaseException) -> str | None:
    """The one line for a lost peer that no :class:`LostPeer` saw (None: ``err`` is no lost peer)."""
    if not is_peer_failure(err):
        return None
    return (
        f"this process lost a peer: {_what_happened(err)}; "
        "resume from the last checkpoint (`--ckpt_path last`)"
    )


class LostPeer:
    """Turns a lost peer into the run's one-line :class:`RankFailure`; ``facts()`` is read only
    when one happens (the step and the last checkpoint are those of that moment)."""

    def __init__(self, facts: Callable[[], RunFacts]) -> None:
        self.facts = facts

    @contextmanager
    def during(self, where: str) -> Iterator[None]:
        """Every rank calls the collectives inside; a lost peer among them ends the run in one line
        (``where``: "stage 'rollout'", "the env-failure check"); other errors pass unchanged."""
        try:
            yield
        except RankFailure:
            raise
        except Exception as err:
            if not is_peer_failure(err):
                raise
            raise self.error(where, err) from err

    def error(self, where: str, err: BaseException) -> RankFailure:
        """The one line; the transport's traceback goes to a file beside the run's logs."""
        f = self.facts()
        path = Path(f.log_dir) / f"rank{f.rank}_failure.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(traceback.format_exception(err)))
            saved = f"traceback in {path}"
        except OSError:
            saved = "traceback not saved"
        resume = (
            f"resume from {f.last_checkpoint}" if f.last_checkpoint else "no checkpoint saved yet"
        )
        return RankFailure(
            f"rank {f.rank} lost a peer during {where} of {f.step}: {_what_happened(err)}; "
            f"{resume} (`--ckpt_path last`); {saved}"
        )

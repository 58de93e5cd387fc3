"""Contracts between the RL module and the callbacks that steer it.

- :class:`StageOOMHandler`: a callback that can recover a stage from an out-of-memory error. The
  module calls ``on_stage_oom`` on every callback of this type when a stage runs out of memory on
  any rank; when one returns True the stage is retried (under the layout the selector picks next).
- :class:`WorkloadSource`: what a module declares so that a layout selector can size its stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import lightning as L

from earl_lightning.parallel.memory import Workload


class StageOOMHandler(L.Callback):
    """Base of callbacks that recover a stage from an out-of-memory error."""

    def on_stage_oom(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        stage: str,
        stats: Mapping[str, Any] | None,
        err: BaseException,
    ) -> bool:
        """Called on every rank after stage ``stage`` ran out of memory on some rank; return True
        when the stage should run again (e.g. the layout that failed was marked infeasible)."""
        return False


@runtime_checkable
class WorkloadSource(Protocol):
    """A LightningModule that declares its workload and tokenizer (AgenticRLModule does)."""

    @property
    def workload(self) -> Workload: ...

    tokenizer: Any

"""Contracts between the RL module and the callbacks that steer it.

- :class:`WorkloadSource`: what a module declares so that a layout selector can size its stages.
- :class:`~earl_lightning.stages.StageOOMHandler` (in ``stages.py``, beside the stage runner that
  calls it): a callback that can recover a stage from an out-of-memory error. The module calls
  ``on_stage_oom`` on every callback of this type when a stage runs out of memory on any rank;
  when one returns True the stage is retried (under the layout the selector picks next).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from earl_lightning.parallel.memory import Workload


@runtime_checkable
class WorkloadSource(Protocol):
    """A LightningModule that declares its workload and tokenizer (AgenticRLModule does)."""

    @property
    def workload(self) -> Workload: ...

    tokenizer: Any

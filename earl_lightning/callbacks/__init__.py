"""Callbacks: AdaptiveParallelism (the layout selector), the step progress bar, ExportModel (the
trained model as a save_pretrained directory), and the contracts
between the RL module and the callbacks that steer it (:mod:`.base`; the out-of-memory hook
:class:`StageOOMHandler` lives in :mod:`earl_lightning.stages`)."""

from earl_lightning.callbacks.adaptive import AdaptiveParallelism
from earl_lightning.callbacks.base import WorkloadSource
from earl_lightning.callbacks.export import ExportModel
from earl_lightning.callbacks.progress import StepProgressBar
from earl_lightning.stages import StageOOMHandler

__all__ = [
    "AdaptiveParallelism",
    "ExportModel",
    "StageOOMHandler",
    "StepProgressBar",
    "WorkloadSource",
]

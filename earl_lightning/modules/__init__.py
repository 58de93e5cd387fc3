"""The RL LightningModule, its typed configuration groups and its DataModule (:mod:`.datamodule`)."""

from earl_lightning.modules.config import (
    AdvantageConfig,
    AlgorithmConfig,
    KLConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    SamplingOptions,
    ValueConfig,
)
from earl_lightning.modules.rl import AgenticRLModule

__all__ = [
    "AdvantageConfig",
    "AgenticRLModule",
    "AlgorithmConfig",
    "KLConfig",
    "LossConfig",
    "OptimConfig",
    "RolloutConfig",
    "SamplingOptions",
    "ValueConfig",
]

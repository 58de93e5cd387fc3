"""earl_lightning: agentic RL of LLMs on PyTorch Lightning, with EARL's adaptive parallelism and dispatcher.

The public API is the names in ``__all__``, importable from here::

    from earl_lightning import AgenticRLModule, EpisodeDataModule, EarlStrategy, AdaptiveParallelism

They stay importable from here whatever module holds them; the modules themselves may move (a
moved one keeps a deprecation shim for one minor version). Each name is imported on first use
(PEP 562), so ``import earl_lightning`` imports neither torch nor Lightning: the ``earl`` command's
start-up and a worker process that needs one light module pay only for what they use.
"""

from __future__ import annotations

import importlib

from earl_lightning.core.warnings_filter import install_warning_filters

__version__ = "0.2.0"

# Two warnings that Lightning raises from its own internals, whatever the caller does
# (warnings_filter.py says why each cannot be fixed at its cause); filtered narrowly, for Python
# users and the `earl` command alike.
install_warning_filters()

__all__ = [
    # the RL LightningModule and its typed configuration groups
    "AgenticRLModule",
    "RolloutConfig",
    "SamplingOptions",
    "AlgorithmConfig",
    "AdvantageConfig",
    "LossConfig",
    "KLConfig",
    "ValueConfig",
    "OptimConfig",
    # the DataModule and its groups
    "EpisodeDataModule",
    "DatasetConfig",
    "DispatchConfig",
    # the warm start (supervised fine-tuning on demonstrations, `earl sft`)
    "WarmStartModule",
    "DemonstrationDataModule",
    # the strategy and the callbacks
    "EarlStrategy",
    "AdaptiveParallelism",
    "StepProgressBar",
    "ExportModel",
    # environments
    "Env",
    "ToolEnv",
    "StepResult",
    "register_env",
    "make_env",
    "env_names",
    # tools and their parsers
    "Tool",
    "ToolCall",
    "ToolResult",
    "ParsedTurn",
    "register_tool_parser",
    # the algorithm registries and their contracts
    "register_policy_loss",
    "PolicyLossStats",
    "register_advantage_estimator",
    "AdvantageInputs",
    "AdvantageOutput",
    "Moments",
    # the tiny offline models
    "make_tiny_model",
]

# where each public name lives (imported on first use by __getattr__)
_WHERE = {
    "AgenticRLModule": "earl_lightning.modules.rl",
    "RolloutConfig": "earl_lightning.modules.config",
    "SamplingOptions": "earl_lightning.modules.config",
    "AlgorithmConfig": "earl_lightning.modules.config",
    "AdvantageConfig": "earl_lightning.modules.config",
    "LossConfig": "earl_lightning.modules.config",
    "KLConfig": "earl_lightning.modules.config",
    "ValueConfig": "earl_lightning.modules.config",
    "OptimConfig": "earl_lightning.modules.config",
    "EpisodeDataModule": "earl_lightning.modules.datamodule",
    "DatasetConfig": "earl_lightning.tasks.datasets",
    "DispatchConfig": "earl_lightning.dispatch.exchange",
    "WarmStartModule": "earl_lightning.sft.module",
    "DemonstrationDataModule": "earl_lightning.sft.datamodule",
    "EarlStrategy": "earl_lightning.strategies.earl",
    "AdaptiveParallelism": "earl_lightning.callbacks.adaptive",
    "StepProgressBar": "earl_lightning.callbacks.progress",
    "ExportModel": "earl_lightning.callbacks.export",
    "Env": "earl_lightning.envs.base",
    "ToolEnv": "earl_lightning.envs.base",
    "StepResult": "earl_lightning.envs.types",
    "register_env": "earl_lightning.envs.base",
    "make_env": "earl_lightning.envs.base",
    "env_names": "earl_lightning.envs.base",
    "Tool": "earl_lightning.tasks.tools",
    "ToolCall": "earl_lightning.tasks.tools",
    "ToolResult": "earl_lightning.tasks.tools",
    "ParsedTurn": "earl_lightning.tasks.tool_parsers",
    "register_tool_parser": "earl_lightning.tasks.tool_parsers",
    "register_policy_loss": "earl_lightning.algorithms.losses",
    "PolicyLossStats": "earl_lightning.algorithms.losses",
    "register_advantage_estimator": "earl_lightning.algorithms.estimators",
    "AdvantageInputs": "earl_lightning.algorithms.estimators",
    "AdvantageOutput": "earl_lightning.algorithms.estimators",
    "Moments": "earl_lightning.algorithms.moments",
    "make_tiny_model": "earl_lightning.models.tiny",
}

# What type checkers and IDEs read (they take any `TYPE_CHECKING` as true; `typing` itself is not
# imported, it would double the import's time); tests/unit/test_public_api.py keeps it in step.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from earl_lightning.algorithms.estimators import (
        AdvantageInputs,
        AdvantageOutput,
        register_advantage_estimator,
    )
    from earl_lightning.algorithms.losses import PolicyLossStats, register_policy_loss
    from earl_lightning.algorithms.moments import Moments
    from earl_lightning.callbacks.adaptive import AdaptiveParallelism
    from earl_lightning.callbacks.export import ExportModel
    from earl_lightning.callbacks.progress import StepProgressBar
    from earl_lightning.dispatch.exchange import DispatchConfig
    from earl_lightning.envs.base import Env, ToolEnv, env_names, make_env, register_env
    from earl_lightning.envs.types import StepResult
    from earl_lightning.models.tiny import make_tiny_model
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
    from earl_lightning.modules.datamodule import EpisodeDataModule
    from earl_lightning.modules.rl import AgenticRLModule
    from earl_lightning.sft.datamodule import DemonstrationDataModule
    from earl_lightning.sft.module import WarmStartModule
    from earl_lightning.strategies.earl import EarlStrategy
    from earl_lightning.tasks.datasets import DatasetConfig
    from earl_lightning.tasks.tool_parsers import ParsedTurn, register_tool_parser
    from earl_lightning.tasks.tools import Tool, ToolCall, ToolResult


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept here after."""
    if name not in _WHERE:
        raise AttributeError(f"module 'earl_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

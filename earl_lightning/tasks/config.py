"""The task a run plays, declared once for both data modules: `earl fit`'s ``EpisodeDataModule``
and `earl sft`'s ``DemonstrationDataModule`` take the same settings under the same ``--data.*``
keys (the environment, the rows, what scores them, the tools, what is held out for evaluation).

Each setting's type and default is defined here, and its check runs here: the data modules keep
their flat keywords (the YAML and CLI keys users write) with these types, and build a
:class:`TaskConfig` from them. Not in ``tasks/__init__``: this module imports ``datasets``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from earl_lightning.core.checks import check_count
from earl_lightning.envs.base import check_env_name, make_env
from earl_lightning.tasks.datasets import DatasetConfig, RowCheck, Splits, describe, open_splits
from earl_lightning.tasks.rewards import RewardFunction, check_columns, resolve_reward_funcs
from earl_lightning.tasks.rows import check_rl_row
from earl_lightning.tasks.tools import Tool, resolve_tools

ARG = "--data"
DEFAULT_ENV = "connect_four"  # played when neither an environment nor a dataset is named

# The types of the settings, as the data modules' signatures (which LightningCLI reads) spell them.
EnvKwargs = dict[str, Any] | None
# Path: jsonargparse then takes a string as a path, never as a settings file to read in (an empty
# .jsonl would become null; a .csv, its own text)
DatasetArg = DatasetConfig | str | Path | datasets.Dataset | datasets.DatasetDict | None
EvalDatasetArg = datasets.Dataset | None
RewardFuncsArg = list[str | Callable[..., Any]] | None
RewardWeightsArg = list[float] | None
ToolsArg = list[str | Callable[..., Any] | dict[str, Any]] | None

# settings that are objects (rows, callables): saved as their description, not as given
OBJECT_SETTINGS = ("dataset", "eval_dataset", "reward_funcs", "tools")


@dataclass(frozen=True)
class TaskConfig:
    """What is played and how it is scored, checked on construction (each error names the
    setting as ``--data.<name>``); :meth:`open` loads the rows and imports the functions.

    Args:
        env: registered environment name or import path of an Env class or factory; null without
            a dataset: ``connect_four`` (set so on construction).
        env_kwargs: keyword arguments of the environment (an environment is built with them now,
            so a bad one fails before any work).
        eval_env_kwargs: overrides of ``env_kwargs`` for evaluation.
        dataset: the rows: a path or hub id, its settings, or a ``datasets.Dataset`` /
            ``DatasetDict``.
        eval_dataset: the evaluation rows, a ``datasets.Dataset``.
        reward_funcs: reward functions with TRL's signature, by import path or as callables.
        reward_weights: one weight per reward function (null: 1.0 each).
        tools: tools the model may call: import paths, callables or ``{schema, fn}`` dicts.
        eval_episodes: evaluation seeds 0..n-1, or the first n evaluation rows (0 disables).
    """

    env: str | None = None
    env_kwargs: EnvKwargs = None
    eval_env_kwargs: EnvKwargs = None
    dataset: DatasetArg = None
    eval_dataset: EvalDatasetArg = None
    reward_funcs: RewardFuncsArg = None
    reward_weights: RewardWeightsArg = None
    tools: ToolsArg = None
    eval_episodes: int = 128

    def __post_init__(self) -> None:
        if self.env is None and self.dataset is None:
            object.__setattr__(self, "env", DEFAULT_ENV)
        check_count(f"{ARG}.eval_episodes", self.eval_episodes, 0)
        if self.env is not None:
            check_env_name(self.env, f"{ARG}.env")
            # bad env kwargs fail now, not at the first step
            make_env(self.env, f"{ARG}.env", **dict(self.env_kwargs or {}))

    def open(
        self, required: Sequence[Sequence[str]] = (("prompt",),), check_row: RowCheck = check_rl_row
    ) -> Task:
        """The task with its rows loaded (``required``, ``check_row``: the forms a row may take,
        as :func:`~earl_lightning.tasks.datasets.open_splits` checks them), its reward functions
        and tools imported, and the columns the reward functions need found in the rows."""
        splits = (
            None
            if self.dataset is None
            else open_splits(
                self.dataset, self.eval_dataset, required=required, check_row=check_row
            )
        )
        funcs = resolve_reward_funcs(self.reward_funcs, self.reward_weights)
        tools = resolve_tools(self.tools)
        if splits is not None:
            check_columns(funcs, splits.columns())
        env_kwargs = dict(self.env_kwargs or {})
        return Task(
            self.env,
            env_kwargs,
            {**env_kwargs, **(self.eval_env_kwargs or {})},
            splits,
            funcs,
            tools,
        )

    def hparams(self, task: Task) -> dict[str, Any]:
        """The settings as plain data, for saved hyperparameters (objects by their description,
        tools by name)."""
        return {
            "env": self.env,
            "dataset": describe(self.dataset),
            "eval_dataset": describe(self.eval_dataset),
            "reward_funcs": [describe(f) for f in self.reward_funcs or []],
            "tools": [t.name for t in task.tools],
        }


@dataclass(frozen=True)
class Task:
    """A :class:`TaskConfig` opened: the environment (null: rows played single-turn), its keyword
    arguments for training and for evaluation, the rows, the reward functions and the tools."""

    env: str | None
    env_kwargs: dict[str, Any]
    eval_env_kwargs: dict[str, Any]
    splits: Splits | None
    reward_funcs: list[RewardFunction]
    tools: list[Tool]

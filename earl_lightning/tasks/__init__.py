"""Tasks as users bring them: rows of a prompt dataset (TRL's standard or conversational
``prompt`` plus any columns) and reward functions with TRL's signature.

Beside ``envs/`` (tier 1): pure Python over ``datasets``, no torch and no trainer. The rollout
plays the rows (``rollout/loop.py``) and scores them (``rollout/scoring.py``); the DataModule
visits them in epochs (``datamodule.py``).
"""

from earl_lightning.tasks.datasets import DatasetConfig, RowOrder, Splits, open_splits
from earl_lightning.tasks.rewards import RewardFunction, call_reward_funcs, resolve_reward_funcs
from earl_lightning.tasks.rows import first_messages, prompt_form

__all__ = [
    "DatasetConfig",
    "RowOrder",
    "Splits",
    "open_splits",
    "RewardFunction",
    "call_reward_funcs",
    "resolve_reward_funcs",
    "first_messages",
    "prompt_form",
]

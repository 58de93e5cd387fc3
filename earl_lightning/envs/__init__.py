"""Environments: the Env protocol and registry, and the built-in envs.

Importing the env modules below registers the built-ins (``openspiel``, ``connect_four``,
``calculator``, ``inventory``, ``textarena``, ``recall``); every ``earl_lightning.envs.*`` import runs this file
first, so they are registered wherever the registry is used. Importing this package needs OpenSpiel
(a core dependency) but not TextArena (an extra, imported when a TextArena env is built).
"""

from earl_lightning.envs.base import (
    ENVS,
    Env,
    StepResult,
    ToolEnv,
    check_env_name,
    env_names,
    make_env,
    register_env,
)
from earl_lightning.envs.calculator import CalcError, CalculatorEnv, safe_eval
from earl_lightning.envs.inventory import InventoryEnv
from earl_lightning.envs.openspiel_env import (
    OpenSpielEnv,
    evaluate_policy,
    preference_policy,
    suitable_games,
    uniform_policy,
)
from earl_lightning.envs.policies import DEMONSTRATION_POLICIES, make_policy
from earl_lightning.envs.recall import RecallEnv
from earl_lightning.envs.textarena_env import RANDOM_OPPONENT_GAMES, TextArenaEnv

__all__ = [
    "ENVS",
    "Env",
    "StepResult",
    "ToolEnv",
    "check_env_name",
    "env_names",
    "make_env",
    "register_env",
    "CalcError",
    "CalculatorEnv",
    "safe_eval",
    "InventoryEnv",
    "OpenSpielEnv",
    "evaluate_policy",
    "preference_policy",
    "suitable_games",
    "uniform_policy",
    "DEMONSTRATION_POLICIES",
    "make_policy",
    "RecallEnv",
    "RANDOM_OPPONENT_GAMES",
    "TextArenaEnv",
]

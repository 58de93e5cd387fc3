"""Environments: the Env protocol and registry, and the built-in envs.

Importing this package needs OpenSpiel (a core dependency) but not TextArena (an extra).
"""

from earl_lightning.envs.base import (Env, StepResult, check_env_name, env_names, make_env,
                                      register_env)
from earl_lightning.envs.calculator import CalcError, CalculatorEnv, safe_eval
from earl_lightning.envs.openspiel_env import (OpenSpielEnv, evaluate_policy, preference_policy,
                                               suitable_games, uniform_policy)
from earl_lightning.envs.textarena_env import RANDOM_OPPONENT_GAMES, TextArenaEnv

__all__ = [
    "Env", "StepResult", "check_env_name", "env_names", "make_env", "register_env",
    "CalcError", "CalculatorEnv", "safe_eval",
    "OpenSpielEnv", "evaluate_policy", "preference_policy", "suitable_games", "uniform_policy",
    "RANDOM_OPPONENT_GAMES", "TextArenaEnv",
]

"""Environments of the libraries the adapters take, written wrong in the ways users write them
wrong (tests name them by import path)."""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class PixelEnv(gymnasium.Env):
    """Image observations: nothing a language model reads."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, (4, 4), dtype=np.uint8)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros((4, 4), dtype=np.uint8), {}

    def step(self, action):
        return np.zeros((4, 4), dtype=np.uint8), 0.0, True, False, {}


class UndeclaredNumbers(gymnasium.Env):
    """No observation space declared, and numbers for observations."""

    def reset(self, *, seed=None, options=None):
        return 3, {}

    def step(self, action):
        return 4, 0.0, True, False, {}


class MoveAction(Action):
    x: int
    y: int


class MoveObservation(Observation):
    board: str = ""


class TwoFieldEnv(Environment):
    """An action of two numbers: no one string field to put the model's text in."""

    def reset(self, seed=None, episode_id=None, **kw) -> MoveObservation:
        return MoveObservation(board=".")

    def step(self, action: MoveAction, timeout_s=None, **kw) -> MoveObservation:
        return MoveObservation(board="x", done=True, reward=1.0)

    @property
    def state(self) -> State:
        return State()

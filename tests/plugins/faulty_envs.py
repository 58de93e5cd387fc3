"""Environments with the faults a user's environment can have, reached by import path
(``tests.plugins.faulty_envs.RaisesInStep``): each is the ``recall`` env, faulty for the seeds
divisible by ``every`` (1: every seed) at turn ``turn``, and healthy for the others."""

from __future__ import annotations

import threading

import numpy as np

from earl_lightning.envs.base import StepResult
from earl_lightning.envs.recall import RecallEnv


class _Faulty(RecallEnv):
    def __init__(self, every: int = 1, turn: int = 0, **recall_kwargs) -> None:
        super().__init__(**recall_kwargs)
        self.every, self.turn = every, turn
        self.faulty = False

    def reset(self, seed: int) -> str:
        self.faulty = seed % self.every == 0
        return super().reset(seed)

    def step(self, action: str) -> StepResult:
        if self.faulty and self._turn == self.turn:
            return self.fault(action)
        return super().step(action)

    def fault(self, action: str):
        raise NotImplementedError


class RaisesInStep(_Faulty):
    def fault(self, action: str):
        raise RuntimeError("step broke")


class RaisesInReset(_Faulty):
    def reset(self, seed: int) -> str:
        observation = super().reset(seed)
        if self.faulty:
            raise OSError("reset broke")
        return observation


class GymTupleStep(_Faulty):
    """``step`` returns gym's ``(observation, reward, terminated, truncated, info)``."""

    def fault(self, action: str):
        res = RecallEnv.step(self, action)
        return res.observation, res.reward, res.done, False, res.info


class GymnasiumReset(_Faulty):
    """``reset`` returns gymnasium's ``(observation, info)``."""

    def reset(self, seed: int):
        observation = super().reset(seed)
        return (observation, {}) if self.faulty else observation


class BadStepResult(_Faulty):
    """``step`` returns a StepResult with one bad field: ``what`` is reward, done, info or observation."""

    def __init__(self, what: str = "reward", **kwargs) -> None:
        super().__init__(**kwargs)
        self.what = what

    def fault(self, action: str):
        res = RecallEnv.step(self, action)
        bad = {
            "reward": float("nan"),
            "done": np.array([True, False]),
            "info": ["invalid_action"],
            "observation": None,
        }
        fields = {
            "observation": res.observation,
            "reward": res.reward,
            "done": False,
            "info": res.info,
        }
        return StepResult(**{**fields, self.what: bad[self.what]})


# Set to end every hang at once (a test's clean-up); cleared, a hang lasts its ``sleep_s``.
RELEASE = threading.Event()


class HangsInStep(_Faulty):
    """``step`` hangs ``sleep_s`` seconds (or until :data:`RELEASE` is set) before answering: a
    hung call, for a time limit below that."""

    def __init__(self, sleep_s: float = 3.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sleep_s = sleep_s

    def fault(self, action: str):
        RELEASE.wait(timeout=self.sleep_s)
        return RecallEnv.step(self, action)

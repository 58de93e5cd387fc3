"""Two small environments written with the libraries users bring, one each, to show (and test)
the adapters of :mod:`earl_lightning.envs.adapters`: a gymnasium ``Env`` and an OpenEnv
``Environment``, named by import path in ``recipes/gymnasium_guess_grpo.yaml`` and
``recipes/openenv_letter_grpo.yaml``. Importing this module imports gymnasium and openenv."""

from __future__ import annotations

import random
import string
from typing import Any

import gymnasium
from gymnasium import spaces
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessDigit(gymnasium.Env):
    """Guess a digit in a few tries; after a wrong guess the environment says higher or lower.

    Reward 1 for the right digit, 0 otherwise; ``terminated`` when it is found, ``truncated``
    after ``max_guesses``; a guess that is not a digit ends the episode with reward -1
    (``info["invalid_action"]``)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_guesses: int = 3) -> None:
        self.max_guesses = max_guesses
        self.observation_space = spaces.Text(max_length=64)
        self.action_space = spaces.Text(max_length=8, charset=string.digits)
        self._target, self._guesses = 0, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self._target, self._guesses = int(self.np_random.integers(10)), 0
        return f"Guess a digit from 0 to 9 in {self.max_guesses} tries.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self._guesses += 1
        text = action.strip()
        if not (len(text) == 1 and text.isdigit()):
            return "Not a digit.", -1.0, True, False, {"invalid_action": True}
        guess = int(text)
        if guess == self._target:
            return "Right.", 1.0, True, False, {"outcome": "win"}
        hint = "Higher." if guess < self._target else "Lower."
        over = self._guesses >= self.max_guesses
        return hint, 0.0, False, over, {"outcome": "loss"} if over else {}


class LetterAction(Action):
    """What the model says."""

    text: str = Field(..., description="the model's answer")


class LetterObservation(Observation):
    """The request, or the verdict."""

    prompt: str = Field(default="", description="what the environment says")


class SayLetter(Environment):
    """Say the letter the environment asks for: reward 1 when the answer is that letter. An
    OpenEnv environment as its docs write one (an Action and an Observation model)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, letters: str = "abcde") -> None:
        super().__init__()
        self.letters, self._target = letters, "a"
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> LetterObservation:
        self._target = random.Random(seed).choice(self.letters)
        self._state = State(episode_id=episode_id, step_count=0)
        return LetterObservation(prompt=f"Say the letter {self._target}.", done=False, reward=0.0)

    def step(
        self, action: LetterAction, timeout_s: float | None = None, **kwargs: Any
    ) -> LetterObservation:
        self._state.step_count += 1
        right = action.text.strip() == self._target
        return LetterObservation(
            prompt="Right." if right else "Wrong.",
            done=True,
            reward=1.0 if right else 0.0,
            metadata={"outcome": "win" if right else "loss"},
        )

    @property
    def state(self) -> State:
        return self._state

"""A user's own environments, kept outside ``earl_lightning`` and reached by import path
(``--data.env tests.plugins.envs.GuessGame``), plus the malformed entries that the registry's
errors are tested against."""

from __future__ import annotations

import random
import re

from earl_lightning.envs.base import StepResult

_INT = re.compile(r"-?\d+")


class GuessGame:
    """Guess a secret integer in ``[low, high]``; each wrong guess is answered "higher" or "lower".

    Finding the number pays ``win_reward`` (``outcome="win"``); running out of guesses pays 0
    (``outcome="loss"``); a reply without a number in range ends the episode with
    ``invalid_reward`` and ``info["invalid_action"] = True``.
    """

    def __init__(
        self,
        low: int = 1,
        high: int = 100,
        max_guesses: int = 7,
        win_reward: float = 1.0,
        invalid_reward: float = -1.0,
    ) -> None:
        if not low < high:
            raise ValueError(f"`low` must be < `high`, got low={low}, high={high}")
        if max_guesses < 1:
            raise ValueError(f"`max_guesses` must be >= 1, got {max_guesses}")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.win_reward, self.invalid_reward = win_reward, invalid_reward

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.left = self.max_guesses
        return (
            f"I picked a number between {self.low} and {self.high}. You have {self.left} guesses. "
            f"Reply with one number."
        )

    def step(self, action: str) -> StepResult:
        match = _INT.search(action)
        guess = int(match.group()) if match else None
        if guess is None or not self.low <= guess <= self.high:
            return StepResult(
                f"Invalid guess {action!r}.", self.invalid_reward, True, {"invalid_action": True}
            )
        self.left -= 1
        if guess == self.secret:
            return StepResult(
                "Correct!", self.win_reward, True, {"invalid_action": False, "outcome": "win"}
            )
        hint = "Higher" if guess < self.secret else "Lower"
        if self.left == 0:
            return StepResult(
                f"{hint}. No guesses left; it was {self.secret}.",
                0.0,
                True,
                {"invalid_action": False, "outcome": "loss"},
            )
        return StepResult(
            f"{hint}. {self.left} guesses left.", 0.0, False, {"invalid_action": False}
        )


def small_guess_game(max_guesses: int = 4) -> GuessGame:
    """A factory: the import path may name a function that returns an Env."""
    return GuessGame(low=1, high=10, max_guesses=max_guesses)


NOT_CALLABLE = 42


class NotAnEnv:
    """Callable, but what it builds has no ``step``."""

    def reset(self, seed: int) -> str:
        return "hello"

"""The task both trainers learn in ``benchmarks/vs_trl.py``: the prompts, the reward, and the two
environments earl_lightning plays them through (named by import path, e.g.
``--data.env benchmarks.vs_trl_env.PromptTask``; the repository root must be on ``sys.path``).

The reward is the share of the completion's length budget filled with digits: a random tiny model
writes ~10% digits and can raise that within a few dozen GRPO steps, so both sides' rewards rise in
a short run. Since it pays per digit, it also rewards not stopping early (eos), which keeps the
tokens generated per step close to ``completion_len`` on both sides.

This module imports neither torch nor the trainers: earl builds an environment per episode.
"""

from __future__ import annotations

from earl_lightning.envs.base import StepResult

NUM_PROMPTS = 64


def prompt_text(index: int) -> str:
    """Prompt ``index`` of the shared set; all prompts have the same length in characters (tokens)."""
    return f"Request {index % NUM_PROMPTS:02d}. Reply with digits only, as many as fit."


def prompts() -> list[str]:
    return [prompt_text(i) for i in range(NUM_PROMPTS)]


def digit_reward(text: str, completion_len: int) -> float:
    """Digits in ``text`` over the token budget ``completion_len`` (one character is one token of
    the earl-tiny tokenizer), capped at 1."""
    return min(1.0, sum(c.isdigit() for c in text) / completion_len)


def _check(name: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")


class PromptTask:
    """Single-turn: ``reset(seed)`` gives prompt ``seed % NUM_PROMPTS``; the one reply is scored by
    :func:`digit_reward` and ends the episode.

    Args:
        completion_len: the reply's token budget (the reward's denominator).
    """

    def __init__(self, completion_len: int = 8) -> None:
        _check("completion_len", completion_len)
        self.completion_len = completion_len

    def reset(self, seed: int) -> str:
        return prompt_text(seed)

    def step(self, action: str) -> StepResult:
        return StepResult("", digit_reward(action, self.completion_len), True, {})


class DigitTurns:
    """Multi-turn: ``turns`` replies, each scored by :func:`digit_reward` / ``turns`` and answered
    with feedback (how many digits it had, which turn comes next). Every episode lasts exactly
    ``turns`` turns, so both trainers do the same number of generation rounds.

    Args:
        completion_len: each reply's token budget.
        turns: replies per episode.
    """

    def __init__(self, completion_len: int = 8, turns: int = 10) -> None:
        _check("completion_len", completion_len)
        _check("turns", turns)
        self.completion_len, self.turns = completion_len, turns
        self._turn = 0

    def reset(self, seed: int) -> str:
        self._turn = 0
        return f"{prompt_text(seed)} Turn 1/{self.turns}."

    def step(self, action: str) -> StepResult:
        if self._turn >= self.turns:
            raise RuntimeError("DigitTurns.step called after the episode ended; call reset()")
        digits = sum(c.isdigit() for c in action)
        self._turn += 1
        reward = digit_reward(action, self.completion_len) / self.turns
        if self._turn == self.turns:
            return StepResult("", reward, True, {})
        return StepResult(
            f"{digits} digits. Turn {self._turn + 1}/{self.turns}: more digits.", reward, False, {}
        )

"""``recall``: a memory task whose context grows by the same number of tokens every turn.

Each turn shows a random digit (seeded) and, optionally, a line of ``padding_chars`` filler text;
the agent must answer the digit shown ``lag`` turns earlier (any answer in the first ``lag``
turns). A correct answer is worth ``1 / num_turns``. The episode lasts exactly ``num_turns``
turns, or ends at the first wrong answer when ``end_on_error``. Every observation of one
configuration has the same length, which makes it the workload of the KV-reuse benchmark and
the selector benchmark (contexts that grow to thousands of tokens).
"""

from __future__ import annotations

import random
import re
import string

from earl_lightning.core.checks import check_count
from earl_lightning.envs.base import StepResult, register_env

_FILLER_CHARS = string.ascii_lowercase + " "
_DIGIT = re.compile(r"\d")


@register_env("recall")
class RecallEnv:
    """Answer the digit shown ``lag`` turns ago.

    Args:
        num_turns: turns per episode (>= 1).
        lag: how many turns back the asked digit was shown (0 <= lag < num_turns).
        padding_chars: length of the filler line added to every observation (0 = none).
        end_on_error: end the episode at the first wrong or missing answer.
    """

    def __init__(
        self, num_turns: int = 10, lag: int = 1, padding_chars: int = 0, end_on_error: bool = False
    ):
        check_count("num_turns", num_turns)
        check_count("lag", lag, 0)
        check_count("padding_chars", padding_chars, 0)
        if lag >= num_turns:
            raise ValueError(f"`lag` of env 'recall' must be < num_turns={num_turns}, got {lag}")
        self.num_turns, self.lag, self.padding_chars = num_turns, lag, padding_chars
        self.end_on_error = bool(end_on_error)
        self._digits: list[int] = []
        self._fillers: list[str] = []
        self._turn = 0
        self._all_correct = True

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self._digits = [rng.randrange(10) for _ in range(self.num_turns)]
        self._fillers = [
            "".join(rng.choices(_FILLER_CHARS, k=self.padding_chars)) for _ in range(self.num_turns)
        ]
        self._turn, self._all_correct = 0, True
        return self._observation(0)

    def _observation(self, t: int) -> str:
        width = len(str(self.num_turns))
        text = f"Turn {t + 1:0{width}d}/{self.num_turns}. Digit: {self._digits[t]}."
        if self.padding_chars:
            text += "\n" + self._fillers[t]
        return text + f"\nAnswer with the digit shown {self.lag} turn(s) ago."

    def expected(self) -> int | None:
        """The digit the current turn asks for (None during the first ``lag`` turns)."""
        return self._digits[self._turn - self.lag] if self._turn >= self.lag else None

    def step(self, action: str) -> StepResult:
        if not self._digits:
            raise RuntimeError("RecallEnv.step called before reset()")
        if self._turn >= self.num_turns:
            raise RuntimeError("RecallEnv.step called after the episode ended; call reset()")
        match = _DIGIT.search(action)
        answer = int(match.group()) if match else None
        expected = self.expected()
        correct = None if expected is None else answer == expected
        self._all_correct &= correct is not False
        self._turn += 1
        done = self._turn == self.num_turns or (self.end_on_error and correct is False)
        info: dict = {"invalid_action": expected is not None and answer is None, "correct": correct}
        if done:
            info["outcome"] = (
                "win" if self._all_correct and self._turn == self.num_turns else "loss"
            )
        reward = 1.0 / self.num_turns if correct else 0.0
        return StepResult("" if done else self._observation(self._turn), reward, done, info)

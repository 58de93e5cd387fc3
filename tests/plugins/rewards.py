"""A user's own reward functions and row environments, reached by import path
(``--data.reward_funcs '[tests.plugins.rewards.exact_sum]'``), written as for TRL's GRPOTrainer."""

from __future__ import annotations

import asyncio
import re
import threading

from earl_lightning.envs.base import StepResult

_INT = re.compile(r"-?\d+")
NOT_CALLABLE = 3
WAKE = threading.Event()  # ends the hung functions' sleep early (a test's clean-up)


def _text(completion) -> str:
    """The last assistant message (conversational form) or the text itself (standard form)."""
    if isinstance(completion, str):
        return completion
    return [m for m in completion if m["role"] == "assistant"][-1]["content"]


def exact_sum(completions, answer, **kwargs):
    """1.0 when the completion's first integer is the row's ``answer`` column, else 0.0."""
    out = []
    for c, a in zip(completions, answer):
        m = _INT.search(_text(c))
        out.append(1.0 if m and int(m.group()) == int(a) else 0.0)
    return out


async def brevity(completions, **kwargs):
    """An async reward: -0.01 per character of the answer."""
    await asyncio.sleep(0)
    return [-0.01 * len(_text(c)) for c in completions]


def only_odd_rows(completions, answer, **kwargs):
    """Applies to rows whose answer is odd only (None elsewhere): TRL's multi-task form."""
    return [1.0 if int(a) % 2 else None for a in answer]


def broken(completions, **kwargs):
    raise ValueError("this reward function is broken")


def sleepy(completions, **kwargs):
    """Hangs: sleeps 60 s (unless a test wakes it), then scores every row 1.0."""
    WAKE.wait(60)
    return [1.0] * len(completions)


async def asleep(completions, **kwargs):
    """An async reward that hangs: awaits 60 s, then scores every row 1.0."""
    await asyncio.sleep(60)
    return [1.0] * len(completions)


def stalls_on_second_row(completions, **kwargs):
    """Raises on a batch (so it is called row by row), scores the first row, hangs on the second."""
    if len(completions) > 1:
        raise ValueError("one row at a time")
    if completions[0] == STALL_ON:
        WAKE.wait(60)
    return [1.0]


STALL_ON = "5"


def verified(completions, answer, **kwargs):
    """math-verify's parse and verify with their own default time-outs (signal.alarm: the main
    thread only)."""
    from math_verify import parse, verify

    return [float(verify(parse(str(a)), parse(_text(c)))) for c, a in zip(completions, answer)]


def wrong_length(completions, **kwargs):
    return [0.0]


def no_completions(prompts, answers):
    return [0.0 for _ in prompts]


class CountDown:
    """A row environment (TRL's environment_factory style): ``reset(seed, start)`` gets the row's
    ``start`` column; each turn the model must say the next number down; reaching 0 pays 1.0."""

    def reset(self, seed: int, start: int) -> str:
        self.left = int(start)
        return f" Count down from {self.left}."

    def step(self, action: str) -> StepResult:
        m = _INT.search(action)
        if m is None or int(m.group()) != self.left - 1:
            return StepResult("Wrong.", 0.0, True, {"invalid_action": True})
        self.left -= 1
        if self.left == 0:
            return StepResult("Done!", 1.0, True, {"outcome": "win"})
        return StepResult(f"{self.left}. Next?", 0.0, False, {})


def same_for_all(completions, **kwargs):
    """0.5 whatever the completion: a reward with no learning signal in it."""
    return [0.5 for _ in completions]

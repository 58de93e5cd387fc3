"""What a guarded env call's faults are: :class:`EnvFault` (an episode's ``error``), the worker's
:class:`CallFailed`, and the check of what ``step`` returned against the :class:`Env` contract.
Kept apart from :mod:`earl_lightning.rollout.env_calls`, which runs the calls, so that the contract
reads in one place."""

from __future__ import annotations

import math
from typing import Any

from earl_lightning.envs.base import StepResult

STEP_CONTRACT = "an Env's step must return StepResult(observation, reward, done, info)"
RESET_CONTRACT = "an Env's reset(seed) must return the first observation as a str"


class EnvFault(Exception):
    """A call into an environment failed; ``str(fault)`` is the episode's ``error``, ``exc`` what
    the environment raised (None for a time-out or a wrong return value)."""

    def __init__(self, message: str, exc: BaseException | None = None) -> None:
        super().__init__(message)
        self.exc = exc

    def where(self) -> str:
        """The innermost ``file:line`` of what the environment raised ('' when it raised nothing)."""
        tb = self.exc.__traceback__ if self.exc is not None else None
        frame = None
        while tb is not None:
            frame, tb = tb, tb.tb_next
        return f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else ""


class CallFailed(Exception):
    """Raised on a worker: ``call`` went wrong (``problem``, of ``kind``; ``exc``: what it raised)."""

    def __init__(
        self, call: str, problem: str, kind: str, exc: BaseException | None = None
    ) -> None:
        super().__init__(problem)
        self.call, self.problem, self.kind, self.exc = call, problem, kind, exc

    @classmethod
    def raised(cls, call: str, exc: BaseException) -> CallFailed:
        return cls(
            call,
            f"raised {exc!r}",
            f"{call}() raised {type(exc).__module__}.{type(exc).__qualname__}",
            exc,
        )


def checked_step(result: Any) -> StepResult | tuple[str, str]:
    """``result`` with a float reward and a bool done, or (what is wrong, the kind of fault)."""
    if isinstance(result, tuple):
        return (
            f"returned a tuple; {STEP_CONTRACT} (a gym-style (observation, reward, terminated, truncated, "
            f"info) tuple is not one)",
            "step() returned a tuple",
        )
    if not isinstance(result, StepResult):
        return (
            f"returned {what_value(result)}; {STEP_CONTRACT}",
            f"step() returned a {type(result).__name__}",
        )
    try:
        reward = float(result.reward)
    except Exception:  # noqa: BLE001 - any value float() refuses is the env's bug
        reward = math.nan
    if not math.isfinite(reward):
        return (
            f"returned a StepResult whose reward {result.reward!r:.60} is not a finite number",
            "step() reward",
        )
    try:
        done = bool(result.done)
    except Exception:  # noqa: BLE001 - e.g. a numpy array of several flags
        return f"returned a StepResult whose done {result.done!r:.60} is not a bool", "step() done"
    if not isinstance(result.info, dict):
        return (
            f"returned a StepResult whose info is {what_value(result.info)}, not a dict",
            "step() info",
        )
    if not done and not isinstance(result.observation, str):
        return (
            f"returned a StepResult whose observation is {what_value(result.observation)}, not a str (the episode "
            f"is not done)",
            "step() observation",
        )
    return StepResult(result.observation, reward, done, result.info)


def what_value(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"

"""What an environment's ``step`` returns: the one type the environment protocol
(:mod:`earl_lightning.envs.base`) and the library adapters (:mod:`earl_lightning.envs.adapters`)
share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """One step of an episode.

    Attributes:
        observation: what the model reads next (the next user message); ignored once ``done``.
        reward: this step's reward, a finite number; an episode's reward is the sum over its steps.
        done: the episode is over (won, lost, drawn, solved, or ended by an invalid action).
        info: anything else: ``"invalid_action": True`` for an action the environment refused,
            ``"outcome"`` (``"win" | "draw" | "loss"``) when a game ends.
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

"""What an environment's ``step`` returns: the one type the environment protocol
(:mod:`earl_lightning.envs.base`) and the library adapters (:mod:`earl_lightning.envs.adapters`)
share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

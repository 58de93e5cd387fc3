"""The environment protocol and the registry that builds environments by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """A text environment played over many turns.

    ``reset(seed)`` returns the first observation. ``step(action)`` takes the model's raw text.
    Malformed or illegal actions are the environment's business: they end the episode with a
    penalty and ``info["invalid_action"] = True``; they never raise. ``info`` may also carry
    ``"outcome"`` (``"win" | "draw" | "loss"``) when a game ends.
    """

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...


_REGISTRY: dict[str, Callable[..., Env]] = {}


def register_env(name: str) -> Callable[[Callable[..., Env]], Callable[..., Env]]:
    def deco(factory: Callable[..., Env]) -> Callable[..., Env]:
        _REGISTRY[name] = factory
        return factory

    return deco


def env_names() -> list[str]:
    _import_builtins()
    return sorted(_REGISTRY)


def make_env(name: str, arg: str = "env", **kwargs: Any) -> Env:
    """Build a registered environment; an unknown name lists the valid ones."""
    _import_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown `{arg}` {name!r}; valid environments: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def check_env_name(name: str, arg: str = "env") -> None:
    """Config-time check, so a typo fails before the first step."""
    _import_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown `{arg}` {name!r}; valid environments: {sorted(_REGISTRY)}")


def _import_builtins() -> None:
    # Imported lazily so that `envs.base` stays importable without OpenSpiel or TextArena.
    from earl_lightning.envs import builtin  # noqa: F401

"""The environment protocol and the registry that builds environments by name or import path.

This module imports nothing from ``earl_lightning.envs`` at import time (the adapters are imported
when an environment is built): the built-in envs import it to register
themselves, and ``earl_lightning/envs/__init__.py`` imports them, so they are registered whenever
any part of the package is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from earl_lightning.core.registry import Registry
from earl_lightning.envs.types import StepResult

__all__ = [
    "ENVS",
    "Env",
    "StepResult",
    "ToolEnv",
    "check_env_name",
    "env_names",
    "make_env",
    "register_env",
]


@runtime_checkable
class Env(Protocol):
    """A text environment played over many turns.

    ``reset(seed)`` returns the first observation. ``step(action)`` takes the model's raw text.
    Malformed or illegal actions are the environment's business: they end the episode with a
    penalty and ``info["invalid_action"] = True``; they never raise. ``info`` may also carry
    ``"outcome"`` (``"win" | "draw" | "loss"``) when a game ends.
    """

    def reset(self, seed: int) -> str:
        """Start an episode (the seed fixes it: the problem, an opponent's moves, the seat) and
        return the first observation, which becomes the first user message."""
        ...

    def step(self, action: str) -> StepResult:
        """Play the model's raw reply ``action``; the result's ``observation`` is the next user
        message, unless ``done``."""
        ...


@runtime_checkable
class ToolEnv(Env, Protocol):
    """An Env that also offers tools (TRL's ``environment_factory`` exposes an environment's methods
    the same way): ``tools()`` returns callables, usually its own bound methods, with type hints and
    docstrings (or ``{"schema": ..., "fn": ...}`` pairs). The model's calls of them come back as
    ``tool`` messages; ``step`` gets the turns that call no tool (e.g. the final answer)."""

    def tools(self) -> list[Any]:
        """The tools of this episode's environment: callables with type hints and a docstring
        (the schema is built from them), or ``{"schema": ..., "fn": ...}`` pairs."""
        ...


class _NotCallable(ValueError):
    """Raised by the registry's ``adapt``, which is handed the object but not the path the user
    wrote; :func:`_factory` re-raises it with the path."""

    def __init__(self, arg: str, obj: Any, path: str = "") -> None:
        self.obj = obj
        where = f" {path!r}" if path else ""
        super().__init__(
            f"`{arg}`{where} is {obj!r:.80} (type {type(obj).__name__}), which is not "
            f"callable; an environment import path must name an Env class or a function "
            f"that returns an Env"
        )


def _as_factory(obj: Any, arg: str) -> Callable[..., Env]:
    """``adapt`` for objects reached by import path: an Env class or a factory is used as is."""
    if not callable(obj):
        raise _NotCallable(arg, obj)
    return obj


ENVS: Registry[Callable[..., Env]] = Registry("environments", adapt=_as_factory)


def register_env(name: str) -> Callable[[Any], Any]:
    """Decorator registering an Env class or factory as ``name`` (usable as ``--data.env name``).

    Args:
        name: the name configs select it by; an environment that is never registered can still be
            named by its import path (``my_package.envs.GuessGame``).

    Returns:
        The decorator; it returns the class or factory unchanged.

    Raises:
        ValueError: when the decorator is applied and ``name`` is already registered (two modules
            cannot silently shadow each other's environment).
    """
    return ENVS.register(name)


def env_names() -> list[str]:
    """The registered environments' names, sorted (what an unknown ``--data.env`` lists)."""
    return ENVS.names()


# classes whose instances passed the Env protocol check (a runtime Protocol isinstance costs
# microseconds, and a rollout builds an environment per episode)
_ENV_TYPES: set[type] = set()


def _is_env(env: Any) -> bool:
    if isinstance(env, Env):
        _ENV_TYPES.add(type(env))
        return True
    return False


def make_env(name: str, arg: str = "env", **kwargs: Any) -> Env:
    """Build the environment registered as ``name``, or the Env class / factory at the import path
    ``name`` (``my_package.envs.GuessGame``), with ``kwargs``; a gymnasium or OpenEnv environment
    is wrapped by its adapter (:mod:`earl_lightning.envs.adapters`).

    Args:
        name: a registered name (:func:`env_names`) or an import path.
        arg: the config argument the name came from (e.g. ``--data.env``); every error names it.
        **kwargs: the environment's keyword arguments (``--data.env_kwargs``).

    Returns:
        A new environment, ready for ``reset(seed)``.

    Raises:
        ValueError: an unknown name (the message lists the registered ones), an import path that
            does not import or names something that is not callable, or a factory whose result
            does not implement the Env protocol.
    """
    from earl_lightning.envs.adapters import adapt_env

    # a gymnasium or OpenEnv environment enters through its adapter
    env = adapt_env(_factory(name, arg)(**kwargs), arg, name)
    if type(env) not in _ENV_TYPES and not _is_env(env):
        raise ValueError(
            f"`{arg}` {name!r} built a {type(env).__name__}, which does not implement the Env "
            f"protocol (reset(seed) -> str, step(action) -> StepResult)"
        )
    return env


def check_env_name(name: str, arg: str = "env") -> None:
    """Config-time check, so a typo or a bad import path fails before the first step."""
    _factory(name, arg)


def _factory(name: str, arg: str) -> Callable[..., Env]:
    try:
        return ENVS.get(name, arg)
    except _NotCallable as err:
        raise _NotCallable(arg, err.obj, name) from None

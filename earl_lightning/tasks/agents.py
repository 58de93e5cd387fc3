"""A user's agent as a task: ``agent(client, row, **columns)``, named by import path in
``--data.agent``, run once per episode against the rollout's OpenAI-compatible endpoint.

``client`` is an ``openai.AsyncOpenAI`` (for an ``async def`` agent) or ``openai.OpenAI`` (for a
plain ``def``, run on a thread of its own) whose ``base_url`` is the endpoint and whose API key
names the episode. ``row`` is the dataset row; the row's columns the agent names as keyword
parameters are also passed by name (TRL's habit for reward functions). It returns the episode's
reward (a number), ``{"reward": ..., "info": {...}}``, or None when ``--data.reward_funcs`` score
the transcript. Pure Python: the endpoint itself is :mod:`earl_lightning.rollout.endpoint`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from earl_lightning.core.registry import import_object

Agent = Callable[..., Any]


def resolve_agent(value: str | Agent, arg: str = "--data.agent") -> Agent:
    """The agent ``value`` names (an import path) or is (a callable), checked to take ``(client,
    row)``; a ValueError naming ``arg`` otherwise."""
    fn = import_object(value, arg) if isinstance(value, str) else value
    shown = f" {value!r}" if isinstance(value, str) else ""
    if not callable(fn):
        raise ValueError(
            f"`{arg}`{shown} is {type(fn).__name__} {fn!r:.60}, not callable; an agent is "
            "`async def agent(client, row, **columns)` (or a plain def)"
        )
    if _positional(fn) < 2:
        raise ValueError(
            f"`{arg}`{shown} cannot be called as agent(client, row): its signature is "
            f"{_signature(fn)}; an agent takes the OpenAI client and the dataset row first"
        )
    return fn


def _positional(fn: Agent) -> int:
    """How many arguments ``fn`` takes by position (a large number for ``*args`` or no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: trusted as it is
        return 1 << 30
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 30
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def check_agent_columns(fn: Agent, columns: list[str], arg: str = "--data.agent") -> None:
    """The agent's required parameters after ``(client, row)`` are columns of the dataset (each
    row's value is passed by name)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in columns
    ]
    if missing:
        raise ValueError(
            f"`{arg}` {_signature(fn)} needs {missing}, which the dataset does not have as "
            f"columns (it has {sorted(columns)}); each row's columns are passed by name"
        )


def _signature(fn: Agent) -> str:
    try:
        return f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def describe_agent(value: str | Agent | None) -> str | None:
    """How a run's hyperparameters record the agent: its import path, or a callable's name."""
    if value is None or isinstance(value, str):
        return value
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"

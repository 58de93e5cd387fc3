"""Environments from the libraries users already have, into the :class:`~earl_lightning.envs.base.Env`
contract: a `gymnasium <https://gymnasium.farama.org>`_ environment with text observations and
actions, and an `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment (its server-side
``Environment`` class, run in this process).

Named by import path like any environment (``--data.env my_package.envs.Wordle`` with
``--data.env_kwargs`` for its constructor): :func:`~earl_lightning.envs.base.make_env` builds the
object and, when it is one of these, wraps it here. Neither library is imported unless such an
environment is built.

- gymnasium: ``reset(seed=seed)`` returns ``(observation, info)`` and ``step(action)`` the
  5-tuple ``(observation, reward, terminated, truncated, info)``; an episode ends at
  ``terminated or truncated`` (``info["truncated"]`` says which), ``info`` passes through
  (``invalid_action``, ``outcome``). Observations must be text: a space of another kind is refused
  when the environment is built.
- OpenEnv: ``reset(seed=...)`` and ``step(Action)`` return an ``Observation`` with ``done`` and
  ``reward``. The action is the ``step`` method's annotated ``Action`` class, built from the
  model's text in its one required string field (``action_field`` names it when there are
  several); the observation's text is its one string field (``observation_field``), else its
  fields as JSON.
"""

from __future__ import annotations

import inspect
import json
import sys
import typing
from typing import Any

from earl_lightning.envs.types import StepResult


def adapt_env(env: Any, arg: str, name: str) -> Any:
    """``env`` wrapped when it is a gymnasium or OpenEnv environment, else ``env`` itself."""
    if _is_instance(env, "gymnasium", "Env"):
        return GymnasiumEnv(env, arg, name)
    if _is_instance(env, "openenv.core.env_server.interfaces", "Environment"):
        return OpenEnvEnv(env, arg, name)
    return env


def _is_instance(obj: Any, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` without importing ``module`` (absent: False)."""
    found = sys.modules.get(module)
    return found is not None and isinstance(obj, getattr(found, cls))


class GymnasiumEnv:
    """A gymnasium environment with text observations and actions, as an :class:`Env`."""

    def __init__(self, env: Any, arg: str = "env", name: str = "") -> None:
        from gymnasium import spaces

        space = getattr(env, "observation_space", None)
        if space is not None and not isinstance(space, spaces.Text):
            raise ValueError(
                f"`{arg}` {name!r} is a gymnasium environment whose observation_space is "
                f"{space!r}; only text environments (gymnasium.spaces.Text observations, the "
                "model's text as the action) can be played by a language model"
            )
        self.env = env

    def reset(self, seed: int) -> str:
        observation, _info = self.env.reset(seed=seed)
        return _text(observation, "reset")

    def step(self, action: str) -> StepResult:
        observation, reward, terminated, truncated, info = self.env.step(action)
        info = {**dict(info or {}), "truncated": bool(truncated)}
        return StepResult(
            _text(observation, "step"), float(reward), bool(terminated or truncated), info
        )


class OpenEnvEnv:
    """An OpenEnv ``Environment`` (run in this process), as an :class:`Env`."""

    def __init__(
        self,
        env: Any,
        arg: str = "env",
        name: str = "",
        action_field: str | None = None,
        observation_field: str | None = None,
    ) -> None:
        self.env, self.arg, self.name = env, arg, name
        self.action_type = _action_type(env, arg, name)
        self.action_field = action_field or _text_field(self.action_type, arg, name)
        self.observation_field = observation_field
        self._seeded = "seed" in inspect.signature(env.reset).parameters or _var_kw(env.reset)

    def reset(self, seed: int) -> str:
        observation = self.env.reset(seed=seed) if self._seeded else self.env.reset()
        return self._text(observation)

    def step(self, action: str) -> StepResult:
        observation = self.env.step(self.action_type(**{self.action_field: action}))
        info = dict(getattr(observation, "metadata", None) or {})
        reward = getattr(observation, "reward", None)
        return StepResult(
            self._text(observation),
            float(reward or 0.0),
            bool(getattr(observation, "done", False)),
            info,
        )

    def _text(self, observation: Any) -> str:
        fields = {
            k: v
            for k, v in observation.model_dump().items()
            if k not in ("done", "reward", "metadata")
        }
        key = self.observation_field
        if key is None:
            texts = [k for k, v in fields.items() if isinstance(v, str)]
            key = texts[0] if len(texts) == 1 else None
        if key is not None:
            return str(fields[key])
        return json.dumps(fields, default=str)


def _action_type(env: Any, arg: str, name: str) -> type:
    hints = typing.get_type_hints(type(env).step)
    action = hints.get("action", next(iter(v for k, v in hints.items() if k != "return"), None))
    if not isinstance(action, type) or not hasattr(action, "model_fields"):
        raise ValueError(
            f"`{arg}` {name!r} is an OpenEnv environment whose step() does not annotate its "
            "action with an Action class (def step(self, action: MyAction)); the adapter builds "
            "that class from the model's text"
        )
    return action


def _text_field(action_type: type, arg: str, name: str) -> str:
    fields = action_type.model_fields
    required = [k for k, f in fields.items() if f.is_required()]
    text = [k for k in required if fields[k].annotation is str]
    if len(required) == 1 and text:
        return text[0]
    raise ValueError(
        f"`{arg}` {name!r}: its action {action_type.__name__} has required fields {required}; "
        "the adapter fills one string field with the model's text (wrap the environment in "
        "earl_lightning.envs.adapters.OpenEnvEnv(env, action_field=...) to name it)"
    )


def _var_kw(fn: Any) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _text(observation: Any, call: str) -> str:
    if not isinstance(observation, str):
        raise TypeError(
            f"the gymnasium environment's {call}() returned an observation of type "
            f"{type(observation).__name__}; text environments return a str"
        )
    return observation

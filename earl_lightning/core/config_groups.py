"""Typed configuration groups: frozen dataclasses that a plain mapping can stand for.

A group given as a dict (Python users, YAML, checkpoints' saved hyperparameters) becomes its
dataclass through :func:`coerce`, with an error naming the setting for an unknown key. Sits below
every layer: it imports nothing from the project.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any, TypeVar

C = TypeVar("C")


def coerce(cls: type[C], value: Any, arg: str) -> C:
    """``value`` as a ``cls``: an instance as is, None as the defaults, a mapping by its fields
    (unknown keys name ``arg`` and the valid ones)."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise ValueError(f"`{arg}` must be a mapping of its settings, got {value!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"`{arg}` has unknown settings {unknown}; valid: {names}")
    return cls(**value)


def to_dict(config: Any) -> dict[str, Any]:
    """A group as plain data (for ``save_hyperparameters`` and TensorBoard's hparams)."""
    if not is_dataclass(config):
        raise TypeError(f"expected a configuration dataclass, got {config!r}")
    return asdict(config)

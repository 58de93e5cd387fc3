"""Multi-turn rollout: the loop (:func:`rollout`), its types, and the generation backends.

The names below are imported on first use, so that importing one light module of this package
(``earl_lightning.rollout.process_worker``, the entry of a worker process) imports neither the
loop nor torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GenerationBackend": "earl_lightning.rollout.backends.base",
    "GenOutput": "earl_lightning.rollout.backends.base",
    "GenRequest": "earl_lightning.rollout.backends.base",
    "SamplingConfig": "earl_lightning.rollout.backends.base",
    "HFBackend": "earl_lightning.rollout.backends.hf",
    "rollout": "earl_lightning.rollout.loop",
    "Episode": "earl_lightning.rollout.types",
    "EpisodeSpec": "earl_lightning.rollout.types",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'earl_lightning.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

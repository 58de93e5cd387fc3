"""Multi-turn rollout: the loop (:func:`rollout`), its types, and the generation backends."""

from earl_lightning.rollout.backends.base import (
    GenerationBackend,
    GenOutput,
    GenRequest,
    SamplingConfig,
)
from earl_lightning.rollout.loop import rollout
from earl_lightning.rollout.types import Episode, EpisodeSpec

__all__ = [
    "Episode",
    "EpisodeSpec",
    "GenerationBackend",
    "GenOutput",
    "GenRequest",
    "HFBackend",
    "SamplingConfig",
    "rollout",
]


def __getattr__(name: str):
    # Lazy, so that the rollout types import without transformers.
    if name == "HFBackend":
        from earl_lightning.rollout.backends.hf import HFBackend

        return HFBackend
    raise AttributeError(name)

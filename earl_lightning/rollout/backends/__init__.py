"""Generation backends: the protocol (:mod:`.base`) and the transformers backend (:mod:`.hf`)."""

from earl_lightning.rollout.backends.base import (
    GenerationBackend,
    GenOutput,
    GenRequest,
    SamplingConfig,
)

__all__ = ["GenerationBackend", "GenOutput", "GenRequest", "SamplingConfig", "HFBackend"]


def __getattr__(name: str):
    # Lazy, so that importing the protocol does not import transformers.
    if name == "HFBackend":
        from earl_lightning.rollout.backends.hf import HFBackend

        return HFBackend
    raise AttributeError(name)

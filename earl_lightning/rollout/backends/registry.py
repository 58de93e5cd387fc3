"""The generation backends by name (``--model.rollout.backend``): ``hf`` and ``vllm``, each module
imported on first use (transformers, vLLM). The protocol (:mod:`.base`) knows none of them; a user's
backend registers here, ``@GENERATION_BACKENDS.register("name")``, or is named by import path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from earl_lightning.core.registry import Registry
from earl_lightning.rollout.backends.base import BackendSpec, GenerationBackend

BackendFactory = Callable[[Any, Any, BackendSpec], GenerationBackend]
GENERATION_BACKENDS: Registry[BackendFactory] = Registry("generation backends")


@GENERATION_BACKENDS.register("hf")
def _hf_backend(model: Any, tokenizer: Any, spec: BackendSpec) -> GenerationBackend:
    from earl_lightning.rollout.backends.hf import HFBackend  # transformers, on first use

    return HFBackend(model, tokenizer, reuse_kv=spec.reuse_kv, share_prompts=spec.share_prompts)


@GENERATION_BACKENDS.register("vllm")
def _vllm_backend(model: Any, tokenizer: Any, spec: BackendSpec) -> GenerationBackend:
    from earl_lightning.rollout.backends.vllm import VLLMBackend  # vLLM, on first use

    return VLLMBackend.from_spec(model, tokenizer, spec)

"""A user's own generation backend, registered by name when its module is imported: the HF
backend under another name, which says when it is built and counts its calls
(``--model.rollout.backend tests.plugins.backends.counting_hf`` reaches it by import path)."""

from __future__ import annotations

from typing import Any

from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.rollout.backends.registry import GENERATION_BACKENDS


class CountingHF(HFBackend):
    calls = 0

    def generate(self, requests: Any, sampling: Any) -> Any:
        type(self).calls += 1
        return super().generate(requests, sampling)


@GENERATION_BACKENDS.register("counting_hf")
def counting_hf(model: Any, tokenizer: Any, spec: Any) -> CountingHF:
    print("counting_hf: built", flush=True)
    return CountingHF(model, tokenizer, reuse_kv=spec.reuse_kv, share_prompts=spec.share_prompts)

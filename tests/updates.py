"""The update's settings for tests that call ``ppo_update`` directly."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from earl_lightning.modules.config import AlgorithmConfig, LossConfig, OptimConfig
from earl_lightning.modules.views import update_view
from earl_lightning.train.update import UpdateConfig


def reference_update(**overrides: Any) -> UpdateConfig:
    """The groups' defaults (``update_view``) on the reference path: no shared-prefix,
    scored-last-layer, causal-chunks, written-out-norm or fused-elementwise fast path, the old log-probs taken from the batch; the
    recipes' clip (0.2, 0.28). ``overrides`` replace fields of the view (what a test varies)."""
    optim = OptimConfig(
        share_prefix=False,
        scored_last_layer=False,
        causal_chunks=False,
        rms_norm_backward=False,
        fused_elementwise=False,
        on_policy_shortcut=False,
    )
    algorithm = AlgorithmConfig(loss=LossConfig(clip_low=0.2, clip_high=0.28))
    return replace(update_view(algorithm=algorithm, optim=optim), **overrides)

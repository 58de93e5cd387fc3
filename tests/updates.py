"""The update's settings for tests that call ``ppo_update`` directly."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from earl_lightning.modules.config import AlgorithmConfig, LossConfig, OptimConfig
from earl_lightning.modules.views import update_view
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.train.update import Models, UpdateConfig, ppo_update


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


def sgd_update(model, batch, **overrides: Any) -> dict[str, float]:
    """One ``ppo_update`` of ``model`` on ``batch`` on the reference path (``overrides`` as
    there), with SGD at lr 0.1, no gradient clipping, entropy 0.01 and micro-batches of 64 tokens;
    its statistics."""
    models = Models(model)
    opt = torch.optim.SGD(models.parameters(), lr=0.1)

    class Opt:  # what ppo_update uses of Lightning's optimizer wrapper
        optimizer, param_groups = opt, opt.param_groups
        step, zero_grad = opt.step, opt.zero_grad

    settings = dict(micro_batch_tokens=64, max_grad_norm=0.0, entropy_coef=0.01)
    cfg = reference_update(**{**settings, **overrides})
    return ppo_update(models, Opt, None, batch, cfg, Reducer(), lambda loss: loss.backward())

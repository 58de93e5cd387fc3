"""Sampled evaluation (``--data.eval_samples n``): beside the greedy figure, each evaluation row (or
seed) is played ``n`` times with the training's sampling, and the run logs ``val/pass@k`` for
``k = 1, 2, 4, ...`` up to ``n`` (and ``n``), with Chen et al.'s unbiased estimator
(:func:`~earl_lightning.algorithms.pass_at_k.pass_at_k`), and ``val/mean@n``, the mean reward of
the samples. A sample passes when its reward reaches ``--data.eval_pass_reward``.

The metrics are torchmetrics that sum over ranks: a row's samples are one group, played on one
data-parallel rank (TP peers: only TP rank 0 counts), so each rank scores whole rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from earl_lightning.algorithms.pass_at_k import pass_at_k
from earl_lightning.modules.metrics import Rate


def pass_ks(samples: int) -> list[int]:
    """The k of pass@k reported for ``samples`` per row: the powers of two below it, and itself."""
    return sorted({2**i for i in range(samples.bit_length()) if 2**i < samples} | {samples})


class SampledEvalMetrics(nn.Module):
    """``val/pass@k`` and ``val/mean@n`` of an evaluation's sampled episodes (a child of the
    LightningModule, so its states follow its device); nothing when ``samples`` is 0."""

    def __init__(self, samples: int, pass_reward: float) -> None:
        super().__init__()
        self.samples, self.pass_reward = samples, pass_reward
        self.ks = pass_ks(samples) if samples else []
        names = [f"pass@{k}" for k in self.ks] + ([f"mean@{samples}"] if samples else [])
        self.rates = nn.ModuleDict({_key(n): Rate(dist_sync_on_step=False) for n in names})

    def update(self, episodes: Sequence[Any], counted: bool) -> None:
        """Add this rank's rows (``episodes`` grouped by ``spec.group_id``; ``counted``: this rank
        is TP rank 0 of its group, else it adds nothing)."""
        rows: dict[int, list[float]] = defaultdict(list)
        for ep in episodes if counted else []:
            rows[ep.spec.group_id].append(float(ep.reward))
        rewards = list(rows.values())
        n = torch.tensor([len(r) for r in rewards], dtype=torch.float64)
        c = torch.tensor(
            [sum(x >= self.pass_reward for x in r) for r in rewards], dtype=torch.float64
        )
        for k in self.ks:
            value = float(pass_at_k(n, c, k).sum()) if rewards else 0.0
            self.rates[_key(f"pass@{k}")].update(value, float(len(rewards)))
        if self.samples:
            total = sum(sum(r) for r in rewards)
            self.rates[_key(f"mean@{self.samples}")].update(total, float(n.sum()))

    def objects(self) -> dict[str, Metric]:
        """The metrics to log (``val/pass@k``, ``val/mean@n``); Lightning computes and resets them."""
        return {"val/" + key.replace("_at_", "@"): m for key, m in self.rates.items()}

    def compute(self) -> dict[str, float]:
        """The values now (synced over ranks), then reset: the evaluation before the first update."""
        out = {name: float(m.compute()) for name, m in self.objects().items()}
        for m in self.rates.values():
            m.reset()
        return out


def _key(name: str) -> str:
    # ModuleDict keys are attribute-like names
    return name.replace("@", "_at_")

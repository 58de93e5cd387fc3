"""Log-probs and entropies from logits, on TRL's memory-frugal kernels.

Convention (data/experience.py): ``logprobs[t]`` is ``log p(input_ids[t] | input_ids[:t])``, which
the model's logits at position ``t - 1`` predict; position 0 has no prediction and holds 0. The
``shifted_*`` helpers turn a forward pass over ``input_ids`` into that convention.
"""

from __future__ import annotations

from functools import lru_cache
from types import ModuleType

import torch
from torch import Tensor

from earl_lightning.algorithms._checks import check_positive
from earl_lightning.algorithms.aggregation import AggregationMode, Number, aggregate


@lru_cache(maxsize=1)
def _trl_utils() -> ModuleType:
    # Imported on first use: TRL pulls in transformers/accelerate (seconds), and the rest of
    # algorithms/ is pure torch. TRL is pinned (==1.16.0) since these helpers are internal.
    from trl.trainer import utils

    return utils


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)[labels]``: logits [B, T, V], labels [B, T] -> [B, T]."""
    check_positive("temperature", temperature)
    if logits.dim() < 2 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"`labels` has shape {tuple(labels.shape)}, expected {tuple(logits.shape[:-1])} "
            f"(the shape of `logits` {tuple(logits.shape)} without its vocabulary dimension)"
        )
    return _trl_utils().selective_log_softmax(logits, labels.long(), temperature=float(temperature))


def shifted_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-token log-probs in the experience convention: logits [B, L, V], input_ids [B, L] -> [B, L].

    Entry ``t`` is ``log p(input_ids[t] | < t)`` from ``logits[:, t - 1]``; entry 0 is 0.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"`input_ids` has shape {tuple(input_ids.shape)}, expected {tuple(logits.shape[:2])} "
            f"to match `logits` {tuple(logits.shape)} [B, L, V]"
        )
    lp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)  # [B, L-1]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)``: [..., V] -> [...]."""
    check_positive("temperature", temperature)
    scaled = logits if temperature == 1.0 else logits / temperature
    return _trl_utils().entropy_from_logits(scaled)


def shifted_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the distribution each token was drawn from: logits [B, L, V] -> [B, L], entry 0 is 0."""
    if logits.dim() != 3:
        raise ValueError(f"`logits` must be [B, L, V], got shape {tuple(logits.shape)}")
    ent = entropy(logits[:, :-1], temperature)  # [B, L-1]
    return torch.cat([ent.new_zeros(ent.shape[0], 1), ent], dim=1)


def entropy_bonus(
    entropies: Tensor,
    mask: Tensor,
    *,
    coef: float,
    mode: AggregationMode = "token_mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
) -> Tensor:
    """The term to ADD to the loss for an entropy bonus: ``-coef * aggregate(entropies, mask, mode)``.

    ``entropies``, ``mask`` [B, T]; the global denominators work as in ``aggregate``.
    """
    return -coef * aggregate(entropies, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs)

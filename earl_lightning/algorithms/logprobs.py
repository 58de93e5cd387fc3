"""Log-probs and entropies from logits, on TRL's memory-frugal kernels.

Convention (batches/experience.py): ``logprobs[t]`` is ``log p(input_ids[t] | input_ids[:t])``, which
the model's logits at position ``t - 1`` predict; position 0 has no prediction and holds 0. The
``shifted_*`` helpers turn a forward pass over ``input_ids`` into that convention.

``allowed`` (1-D token ids) restricts the policy to those tokens: log-probs and entropies are then
those of the softmax over the allowed tokens' logits alone, the distribution a generation backend
samples from when it masks every other token (``SamplingConfig.allowed_token_ids``). A label
outside the set (a prompt token: never a generated one) gets the log-prob of ``allowed[0]``, a
finite placeholder that the action mask removes.
"""

from __future__ import annotations

from functools import lru_cache
from types import ModuleType

import torch
from torch import Tensor

from earl_lightning.algorithms.aggregation import AggregationMode, Number, aggregate
from earl_lightning.core.checks import check_number


@lru_cache(maxsize=1)
def _trl_utils() -> ModuleType:
    # Imported on first use: TRL pulls in transformers/accelerate (seconds), and the rest of
    # algorithms/ is pure torch. TRL is pinned (==1.16.0) since these helpers are internal.
    from trl.trainer import utils

    return utils


def restrict_to_allowed(
    logits: Tensor, labels: Tensor | None, allowed: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The allowed tokens' logits [..., K] and the labels re-indexed into them (0 outside the set)."""
    allowed = allowed.to(device=logits.device, dtype=torch.long)
    if allowed.dim() != 1 or allowed.numel() == 0:
        raise ValueError(
            f"`allowed` must be a non-empty 1-D tensor of token ids, got shape {tuple(allowed.shape)}"
        )
    vocab = logits.shape[-1]
    if int(allowed.min()) < 0 or int(allowed.max()) >= vocab:
        raise ValueError(
            f"`allowed` token ids must lie in [0, {vocab}) (the logits' vocabulary), "
            f"got {allowed.tolist()[:8]}"
        )
    sub = logits.index_select(-1, allowed)
    if labels is None:
        return sub, None
    where = torch.zeros(vocab, dtype=torch.long, device=logits.device)
    where[allowed] = torch.arange(allowed.numel(), device=logits.device)
    return sub, where[labels.long()]


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, allowed: Tensor | None = None
) -> Tensor:
    """``log softmax(logits / temperature)[labels]``: logits [B, T, V], labels [B, T] -> [B, T].

    With ``allowed``, the softmax runs over the allowed tokens only (module docstring)."""
    check_number("temperature", temperature, low=0, strict=True)
    if logits.dim() < 2 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"`labels` has shape {tuple(labels.shape)}, expected {tuple(logits.shape[:-1])} "
            f"(the shape of `logits` {tuple(logits.shape)} without its vocabulary dimension)"
        )
    if allowed is not None:
        logits, labels = restrict_to_allowed(logits, labels, allowed)
    return _trl_utils().selective_log_softmax(logits, labels.long(), temperature=float(temperature))


def shifted_logprobs(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0, allowed: Tensor | None = None
) -> Tensor:
    """Per-token log-probs in the experience convention: logits [B, L, V], input_ids [B, L] -> [B, L].

    Entry ``t`` is ``log p(input_ids[t] | < t)`` from ``logits[:, t - 1]``; entry 0 is 0.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"`input_ids` has shape {tuple(input_ids.shape)}, expected {tuple(logits.shape[:2])} "
            f"to match `logits` {tuple(logits.shape)} [B, L, V]"
        )
    lp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature, allowed)  # [B, L-1]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def entropy(logits: Tensor, temperature: float = 1.0, allowed: Tensor | None = None) -> Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` (over ``allowed`` only when given): [..., V] -> [...]."""
    check_number("temperature", temperature, low=0, strict=True)
    if allowed is not None:
        logits, _ = restrict_to_allowed(logits, None, allowed)
    scaled = logits if temperature == 1.0 else logits / temperature
    return _trl_utils().entropy_from_logits(scaled)


def shifted_entropy(
    logits: Tensor, temperature: float = 1.0, allowed: Tensor | None = None
) -> Tensor:
    """Entropy of the distribution each token was drawn from: logits [B, L, V] -> [B, L], entry 0 is 0."""
    if logits.dim() != 3:
        raise ValueError(f"`logits` must be [B, L, V], got shape {tuple(logits.shape)}")
    ent = entropy(logits[:, :-1], temperature, allowed)  # [B, L-1]
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

"""Advantages of an :class:`ExperienceBatch` with a registered estimator, wherever its rows live.

A GRPO group or a REINFORCE++ batch is spread across data-parallel ranks after the exchanger
ran. Its mean and std need only sums and counts: the estimator hands its local
:class:`~earl_lightning.algorithms.moments.Moments` to ``reduce`` (a
:meth:`~earl_lightning.parallel.collectives.Reducer.sum_moments`, TP replicas counted once) and
runs the same code as in one process, so rewards never leave their rank and the result equals
the single-process one (up to float64 summation order).
"""

from __future__ import annotations

import hashlib

import torch

from earl_lightning.algorithms import outcome_to_token_rewards
from earl_lightning.algorithms.estimators import (
    AdvantageEstimator,
    AdvantageInputs,
    MomentsReduce,
    local_moments,
)
from earl_lightning.batches.experience import ExperienceBatch


def estimate_advantages(
    batch: ExperienceBatch,
    estimator: AdvantageEstimator,
    params: dict,
    *,
    num_groups: int,
    reduce: MomentsReduce = local_moments,
    kl_penalty: torch.Tensor | None = None,
) -> ExperienceBatch:
    """Add per-token ``advantages`` (and ``returns`` when the estimator gives value targets).

    ``params``: the estimator's keyword parameters (already checked against it at config time).
    ``kl_penalty`` [B, T]: ``coef * KL`` to subtract from the token rewards (KL in the reward).
    """
    mask = batch.padded("action_mask", 0.0)
    seqs = batch.seqs
    # One reward per EPISODE in per-episode statistics, however many turn rows it was packed into.
    first = (
        seqs["turn_index"] == 0
        if "turn_index" in seqs
        else torch.ones(batch.num_seqs, dtype=torch.bool)
    )
    inputs = AdvantageInputs(
        rewards=seqs["rewards"],
        group_ids=seqs["group_ids"],
        num_groups=num_groups,
        episode_rows=first,
        token_rewards=token_rewards_padded(batch, mask, kl_penalty),
        mask=mask,
        values=batch.padded("values", 0.0) if "values" in batch.tokens else None,
        state_keys=state_keys(batch)
        if estimator.needs_state_keys and "turn_index" in seqs
        else None,
    )
    out = estimator(inputs, reduce, **params)
    tokens = dict(batch.tokens)
    tokens["advantages"] = batch.unpad(out.advantages)
    if out.returns is not None:
        tokens["returns"] = batch.unpad(out.returns)
    return ExperienceBatch(batch.cu_seqlens, tokens, dict(seqs))


def token_rewards_padded(
    batch: ExperienceBatch, mask: torch.Tensor, kl_penalty: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] per-token rewards: the per-turn ``token_rewards`` when the batch has them, else each
    sequence's reward on its last generated token; minus ``kl_penalty`` on generated tokens."""
    if "token_rewards" in batch.tokens:
        r = batch.padded("token_rewards", 0.0) * mask
    else:
        r = outcome_to_token_rewards(batch.seqs["rewards"], mask)
    if kl_penalty is not None:
        r = r - kl_penalty * mask
    return r


def state_keys(batch: ExperienceBatch) -> torch.Tensor:
    """[S] int64: one key per turn row, equal for the rows of one group whose prompts (the tokens
    before the row's first generated token) are equal: the turns a group took in the same state.
    A stable 64-bit hash of the group id and the prompt's token ids (the same on every rank)."""
    ids, mask, cu = (
        batch.tokens["input_ids"],
        batch.tokens["action_mask"],
        batch.cu_seqlens.tolist(),
    )
    keys = []
    for i, group in enumerate(batch.seqs["group_ids"].tolist()):
        row, gen = ids[cu[i] : cu[i + 1]], mask[cu[i] : cu[i + 1]].nonzero()
        prompt = row[: int(gen[0])] if gen.numel() else row
        digest = hashlib.blake2b(
            prompt.to(torch.int64).numpy().tobytes(),
            digest_size=8,
            key=group.to_bytes(8, "little", signed=True),
        ).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(keys, dtype=torch.long)


def check_whole_groups(
    name: str, estimator: AdvantageEstimator, world_size: int, keep_groups: bool
) -> None:
    """An estimator that compares a group's turn rows (``needs_state_keys``) needs each group's rows
    on one rank: on more than one process, ``--data.dispatch.keep_groups`` must be true."""
    if estimator.needs_state_keys and world_size > 1 and not keep_groups:
        raise ValueError(
            f"`--model.algorithm.advantage.name` {name!r} compares the turns of a group taken in the "
            f"same state, so each group's rows must stay on one rank: set "
            f"`--data.dispatch.keep_groups true` (this run has {world_size} processes)"
        )

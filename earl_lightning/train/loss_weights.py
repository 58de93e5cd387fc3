"""What each generated token weighs in the update's loss: the rollout correction's importance
weights (:mod:`earl_lightning.algorithms.correction`) and the tokens it leaves out (tokens masked by
MIS; with ``mask_truncated``, every row of an episode cut by its turn, context or token limit, as
TRL's ``mask_truncated_completions``).

:func:`add_loss_weights` adds two token fields before the update: ``loss_mask`` (1 where a token
counts in the loss and in its denominators; ``action_mask`` without either option) and
``is_weights`` (the policy loss's per-token factor; 1 without a correction). Its statistics come
back as this rank's sums and extremes, for the update to reduce over ranks.
"""

from __future__ import annotations

import torch

from earl_lightning.algorithms.correction import RolloutCorrection
from earl_lightning.batches.experience import ExperienceBatch

# local statistics -> how the update combines them over ranks
SUMMED = ("tokens", "weight_sum", "outside", "truncated_rows")
MAXED = ("weight_max", "neg_weight_min")


def add_loss_weights(
    batch: ExperienceBatch,
    correction: RolloutCorrection | None,
    mask_truncated: bool,
    chunk_tokens: int,
) -> tuple[ExperienceBatch, dict[str, float]]:
    """``batch`` with ``loss_mask`` and ``is_weights`` [N], and this rank's statistics: generated
    ``tokens``, the sum, max and negated min of their weights before the bounds, how many the
    mode changed (``outside``), and the rows left out as truncated. The weights are computed
    ``chunk_tokens`` padded tokens of rows at a time (the micro-batch budget)."""
    act = batch.tokens["action_mask"].float()
    keep, weights = act.clone(), torch.ones_like(act)
    stats = dict.fromkeys((*SUMMED, *MAXED), 0.0)
    if mask_truncated and batch.num_seqs:
        rows = batch.token_seq_index().to(act.device)  # [N]: each token's row
        cut = batch.seqs["truncated"].to(act.device).bool()  # [S]
        has_actions = torch.zeros(batch.num_seqs, device=act.device).index_add_(0, rows, act) > 0
        stats["truncated_rows"] = float((cut & has_actions).sum())
        keep = keep * (~cut)[rows].float()
    if correction is not None:
        if "old_logprobs" not in batch.tokens:
            raise ValueError(
                "the rollout correction weighs the trainer's old log-probs against the rollout's: "
                "the batch has no `old_logprobs` (an update with the on-policy shortcut takes none)"
            )
        w, kept, raw = _corrected(batch, correction, chunk_tokens)
        keep, weights = keep * kept, w
        on = act > 0
        stats.update(
            tokens=float(on.sum()),
            weight_sum=float(raw[on].double().sum()),
            outside=float((on & (w != raw)).sum()),
            weight_max=float(raw[on].max()) if bool(on.any()) else 0.0,
            neg_weight_min=float(-raw[on].min()) if bool(on.any()) else float("-inf"),
        )
    tokens = {**batch.tokens, "loss_mask": keep, "is_weights": weights}
    return ExperienceBatch(batch.cu_seqlens, tokens, dict(batch.seqs)), stats


def _corrected(
    batch: ExperienceBatch, correction: RolloutCorrection, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The correction's weights, keep flags and raw weights [N], over padded chunks of rows."""
    n, device = batch.num_tokens, batch.tokens["action_mask"].device
    weights, keep = torch.zeros(n, device=device), torch.zeros(n, device=device)
    raw = torch.ones(n, device=device)
    for idx in batch.micro_batch_indices(chunk_tokens):
        part = batch.select(idx)
        got = correction.weights(
            part.padded("old_logprobs", 0.0),
            part.padded("rollout_logprobs", 0.0),
            part.padded("action_mask", 0.0),
        )
        pos = batch.token_positions(idx).to(device)
        weights[pos] = part.unpad(got.weights).float()
        keep[pos] = part.unpad(got.keep).float()
        raw[pos] = part.unpad(got.raw).float()
    return weights, keep, raw


def correction_metrics(
    totals: dict[str, float], correction: bool, truncated: bool
) -> dict[str, float]:
    """The logged figures from the statistics summed (and maxed) over ranks."""
    out = {}
    if correction:
        n = max(totals["tokens"], 1.0)
        out["rollout_correction/weight_mean"] = totals["weight_sum"] / n
        out["rollout_correction/weight_max"] = totals["weight_max"]
        out["rollout_correction/weight_min"] = (
            -totals["neg_weight_min"] if totals["tokens"] else 0.0
        )
        out["rollout_correction/outside_share"] = totals["outside"] / n
    if truncated:
        out["train/truncated_rows_masked"] = totals["truncated_rows"]
    return out

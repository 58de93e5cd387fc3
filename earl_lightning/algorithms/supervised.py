"""The warm start's supervised loss: next-token cross-entropy on labelled tokens, where some
positions are trained on a target *distribution* instead of one token.

A demonstration policy that states its distribution over actions (``random_legal``: uniform over
the legal moves) gives, for a turn's first token, the expected negative log-likelihood over the
actions it would play: ``-sum_a q(a) log p(a)``. The sampled action is one draw of that expectation;
for a one-token action the two have the same mean and the expected form has no sampling noise (for
uniform targets over six of seven columns, the noise of one draw is what hides the rule that a full
column is never played). Later tokens of a turn keep the played action's label (an unbiased estimate
of the rest of the expected loss).
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_token_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    soft_rows: Tensor | None = None,
    soft_pos: Tensor | None = None,
    soft_owner: Tensor | None = None,
    soft_tokens: Tensor | None = None,
    soft_probs: Tensor | None = None,
) -> Tensor:
    """Mean next-token cross-entropy over the labelled tokens (``labels != -100``).

    Args:
        logits: ``[B, T, V]``; position ``t`` predicts ``labels[:, t + 1]``.
        labels: ``[B, T]`` token ids, -100 where not trained.
        soft_rows, soft_pos: ``[N]`` the row and the (labelled) position of each soft target; that
            position's loss becomes ``-sum_k q_k log p(token_k)``.
        soft_owner, soft_tokens, soft_probs: ``[M]`` the entries of the soft targets: which target
            each belongs to, its token and its probability (each target's sum to 1).

    With no soft targets this is exactly the loss of a Hugging Face causal LM given ``labels``.
    """
    shifted = labels[:, 1:]
    valid = shifted != -100
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    nll = torch.nn.functional.cross_entropy(
        flat, shifted.reshape(-1), ignore_index=-100, reduction="none"
    ).view_as(shifted)
    if soft_rows is not None and soft_rows.numel():
        if not bool(valid[soft_rows, soft_pos - 1].all()):
            raise ValueError(
                "soft_token_cross_entropy: a soft target sits on a position that is not labelled"
            )
        logp = logits[soft_rows, soft_pos - 1].float().log_softmax(-1)  # [N, V]
        entry = logp[soft_owner, soft_tokens] * soft_probs
        soft_nll = -torch.zeros(len(soft_rows), dtype=entry.dtype, device=entry.device).index_add(
            0, soft_owner, entry
        )
        nll = nll.index_put((soft_rows, soft_pos - 1), soft_nll)
    return (nll * valid).sum() / valid.sum().clamp(min=1)

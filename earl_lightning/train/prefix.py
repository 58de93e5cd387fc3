"""A shared-prefix forward: sequences that begin with the same prompt (a GRPO group's completions,
a multi-turn group's first observation) run that prompt through the model once.

The prompt of a sequence is everything before its first generated token (``action_mask``). The
distinct prompts of a micro-batch go through the model as one left-padded batch that keeps its KV
cache (with autograd); the cache is then indexed out to every sequence and the rest of each sequence
runs on top of it. Gradients flow back through the index into the one prompt pass, so the loss and
its gradients are the same as those of the plain forward over the whole sequences (up to float
rounding: the matrix products have other shapes), at a fraction of the tokens when groups are large.

A group of ``G`` sequences with a prompt of ``p`` tokens and replies of ``r`` costs ``p + G * r``
token-passes instead of ``G * (p + r)``. :func:`plan_shared_prefix` takes the shared path only where
that saves at least :data:`MIN_SAVING` of the padded tokens; :func:`can_share_prefix` rules out
models where it cannot run (activation checkpointing recomputes a layer, and a recomputed layer
would append to the cache a second time; sliding-window caches drop old columns).

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.parallel.parallelize import recomputes_activations

PerPosition = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]]
# share only when the two passes cost at most 75% of the plain pass's padded tokens
MIN_SAVING = 0.25


@dataclass(frozen=True)
class PrefixPlan:
    """How a micro-batch splits into distinct prompts and per-sequence continuations.

    ``row_prefix[i]``: the prompt of sequence ``i`` (an index into the distinct prompts);
    ``prefix_rows[u]``: one sequence that has prompt ``u``; ``prefix_lens[i]``: the length of
    sequence ``i``'s prompt (>= 1)."""

    row_prefix: torch.Tensor  # [S] long
    prefix_rows: torch.Tensor  # [U] long
    prefix_lens: torch.Tensor  # [S] long

    @property
    def num_prefixes(self) -> int:
        return int(self.prefix_rows.numel())

    @property
    def saved_tokens(self) -> int:
        """Token passes the shared forward saves: every sequence's prompt, less each distinct one once."""
        return int(self.prefix_lens.sum()) - int(self.prefix_lens[self.prefix_rows].sum())


def can_share_prefix(model: nn.Module) -> bool:
    """Whether the model's forward can continue from a cache with gradients (see the module doc)."""
    if recomputes_activations(model):
        return False  # a recomputed layer would append its keys to the cache a second time
    # the rollout's reading of the config (no HF config, or a layer type the cache path does not
    # know: not shared)
    from earl_lightning.rollout.backends.kv import full_attention_only

    return full_attention_only(model)


def prefix_plan(model: nn.Module, mb: ExperienceBatch, enabled: bool = True) -> PrefixPlan | None:
    """:func:`plan_shared_prefix` where ``enabled`` and the model allows it (:func:`can_share_prefix`)."""
    return plan_shared_prefix(mb) if enabled and can_share_prefix(model) else None


def plan_shared_prefix(mb: ExperienceBatch) -> PrefixPlan | None:
    """The plan for ``mb``, or None when no prompt is shared enough to pay for a second pass."""
    lens = mb.seq_lens.cpu()
    s = int(lens.numel())
    if s < 2:
        return None
    starts = mb.cu_seqlens[:-1].cpu()
    act = mb.tokens["action_mask"].detach().cpu() > 0
    first = torch.where(act, mb.token_offsets(), torch.iinfo(torch.long).max)
    # a sequence's prompt: up to its first generated token, or all of it when it generated none
    plen = lens.clone().scatter_reduce(0, mb.token_seq_index(), first, reduce="amin")
    if bool((plen < 1).any()):
        return None  # a sequence that starts with a generated token has no prompt to continue from
    ids = mb.tokens["input_ids"].detach().cpu()
    seen: dict[bytes, int] = {}
    row_prefix, prefix_rows = [], []
    for i, (st, p) in enumerate(zip(starts.tolist(), plen.tolist())):
        key = ids[st : st + p].numpy().tobytes()
        if key not in seen:
            seen[key] = len(prefix_rows)
            prefix_rows.append(i)
        row_prefix.append(seen[key])
    u = len(prefix_rows)
    width = int((lens - plen).max())
    cost = u * int(plen.max()) + s * width
    if u == s or cost > (1.0 - MIN_SAVING) * s * int(lens.max()):
        return None
    return PrefixPlan(torch.tensor(row_prefix), torch.tensor(prefix_rows), plen)


def shared_prefix_forward(
    model: nn.Module,
    mb: ExperienceBatch,
    plan: PrefixPlan,
    per_position: PerPosition,
    *,
    need_hidden: bool,
) -> dict[str, torch.Tensor]:
    """``per_position`` of ``mb``'s tokens, computed as one pass over the distinct prompts plus one
    over the continuations; returns packed ``[N]`` tensors like :meth:`ExperienceBatch.unpad` would.

    ``per_position(logits, input_ids, hidden)`` maps padded ``[R, C, ...]`` model outputs to
    ``[R, C]`` quantities where entry ``c`` belongs to token ``c`` and is computed from column
    ``c - 1`` (the experience convention); it is called once per pass."""
    dev = mb.tokens["input_ids"].device
    pre_ids, pre_mask = _prompts(mb, plan, dev)
    pre = model(
        input_ids=pre_ids,
        attention_mask=pre_mask,
        position_ids=(pre_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        output_hidden_states=need_hidden,
    )
    cont_ids, cont_mask = _continuations(mb, plan, dev)
    rp = plan.row_prefix.to(dev)
    cache = pre.past_key_values
    cache.batch_select_indices(rp)  # every sequence's own view of its prompt's keys and values
    pos = plan.prefix_lens.to(dev)[:, None] + torch.arange(cont_ids.shape[1], device=dev)[None, :]
    cont = model(
        input_ids=cont_ids,
        attention_mask=torch.cat([pre_mask[rp], cont_mask], 1),
        position_ids=pos,
        past_key_values=cache,
        use_cache=False,
        output_hidden_states=need_hidden,
    )
    # The continuation's view starts at the prompt's last position, whose logits predict the
    # first generated token; positions inside the prompt come from the prompt pass.
    pre_out = per_position(pre.logits, pre_ids, pre.hidden_states[-1] if need_hidden else None)
    cont_out = per_position(
        torch.cat([pre.logits[rp, -1:], cont.logits], 1),
        torch.cat([pre_ids[rp, -1:], cont_ids], 1),
        torch.cat([pre.hidden_states[-1][rp, -1:], cont.hidden_states[-1]], 1)
        if need_hidden
        else None,
    )
    src = token_sources(mb, plan, pre_ids.shape[1], cont_ids.shape[1]).to(dev)
    out = {}
    for name, a in pre_out.items():
        flat = torch.cat([a.reshape(-1), cont_out[name].reshape(-1), a.new_zeros(1)])
        out[name] = flat[src]
    return out


def token_sources(mb: ExperienceBatch, plan: PrefixPlan, p_max: int, width: int) -> torch.Tensor:
    """For each packed token, its index in ``cat(prompt_view.flatten(), continuation_view.flatten(), [0])``:
    a prompt token of sequence ``i`` at position ``t`` sits at column ``p_max - p_i + t`` of its prompt's
    row; a generated (or later) token at column ``t - p_i + 1`` of row ``i``; position 0 (nothing
    predicts it) reads the trailing 0."""
    lens = mb.seq_lens.cpu()
    row, t = mb.token_seq_index(), mb.token_offsets()
    p = plan.prefix_lens[row]
    u = plan.row_prefix[row]
    in_prompt = u * p_max + (p_max - p + t)
    after = plan.num_prefixes * p_max + row * (width + 1) + (t - p + 1)
    src = torch.where(t < p, in_prompt, after)
    return torch.where(
        t == 0, torch.full_like(src, plan.num_prefixes * p_max + lens.numel() * (width + 1)), src
    )


def _prompts(mb: ExperienceBatch, plan: PrefixPlan, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct prompts, left-padded so that every one ends at the last column: ids, mask."""
    ids, starts, plen = (
        mb.tokens["input_ids"],
        mb.cu_seqlens[:-1].tolist(),
        plan.prefix_lens.tolist(),
    )
    rows = plan.prefix_rows.tolist()
    p_max = max(plen[r] for r in rows)
    out = torch.zeros(len(rows), p_max, dtype=ids.dtype, device=dev)
    mask = torch.zeros(len(rows), p_max, dtype=torch.long, device=dev)
    for j, r in enumerate(rows):
        out[j, p_max - plen[r] :] = ids[starts[r] : starts[r] + plen[r]]
        mask[j, p_max - plen[r] :] = 1
    return out, mask


def _continuations(mb: ExperienceBatch, plan: PrefixPlan, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence after its prompt, right-padded (at least one column): ids, mask."""
    ids, starts, lens, plen = (
        mb.tokens["input_ids"],
        mb.cu_seqlens[:-1].tolist(),
        mb.seq_lens.tolist(),
        plan.prefix_lens.tolist(),
    )
    width = max(1, max(n - p for n, p in zip(lens, plen)))
    out = torch.zeros(len(lens), width, dtype=ids.dtype, device=dev)
    mask = torch.zeros(len(lens), width, dtype=torch.long, device=dev)
    for i, (st, n, p) in enumerate(zip(starts, lens, plen)):
        out[i, : n - p] = ids[st + p : st + n]
        mask[i, : n - p] = 1
    return out, mask

"""Glue between rollouts, the model and the pure algorithms: episodes -> packed experience,
log-probs / values / entropy of an experience micro-batch, advantages.

No Lightning here: these functions are what the LightningModule's training step is made of, and
what the invariance tests call directly.
"""

from __future__ import annotations

from typing import Callable

import torch

from earl_lightning.algorithms import (
    grpo_advantages,
    gae_advantages,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    shifted_entropy,
    shifted_logprobs,
)
from earl_lightning.data.experience import ExperienceBatch
from earl_lightning.rollout.types import Episode


def episodes_to_experience(episodes: list[Episode], *, gamma: float = 1.0) -> ExperienceBatch:
    """Pack episodes (no padding). Failed episodes (env exception) keep their tokens but get an
    all-zero action mask: they are counted in the metrics and contribute nothing to the loss.

    An episode whose turns saw the whole chat is one row; ``token_rewards`` holds each turn's
    reward on that turn's last generated token (see :func:`turn_token_rewards`), what the
    token-level estimators (REINFORCE++, GAE) discount. An episode played with a history window
    (``Episode.turn_prompts``) becomes one row per turn: that turn's prompt (mask 0) and its
    generated tokens (mask 1); its last generated token carries the turn's reward plus ``gamma``
    times the return of the turns after it (the Monte-Carlo continuation, so returns within a row
    are the episode's returns-to-go). Per-row fields: ``rewards`` (the episode's), ``group_ids``,
    ``episode_ids``, ``truncated``, ``num_turns`` and ``turn_index`` (0 for a whole-episode row).
    """
    tokens: dict[str, list[torch.Tensor]] = {"input_ids": [], "action_mask": [], "rollout_logprobs": [],
                                             "token_rewards": []}
    rows: list[tuple[Episode, int]] = []
    for ep in episodes:
        if ep.turn_prompts and len(ep.turn_prompts) == len(ep.turn_starts):
            for k, row in enumerate(_turn_rows(ep, gamma)):
                for name, value in zip(("input_ids", "action_mask", "rollout_logprobs", "token_rewards"), row):
                    tokens[name].append(value)
                rows.append((ep, k))
            continue
        mask = torch.tensor(ep.action_mask, dtype=torch.float32)
        if ep.error is not None:
            mask.zero_()
        tokens["input_ids"].append(torch.tensor(ep.token_ids, dtype=torch.long))
        tokens["action_mask"].append(mask)
        tokens["rollout_logprobs"].append(torch.tensor(ep.logprobs, dtype=torch.float32))
        tokens["token_rewards"].append(turn_token_rewards(ep, mask))
        rows.append((ep, 0))
    seqs = {
        "rewards": torch.tensor([ep.reward for ep, _ in rows], dtype=torch.float32),
        "group_ids": torch.tensor([ep.spec.group_id for ep, _ in rows], dtype=torch.long),
        "episode_ids": torch.tensor([ep.spec.episode_id for ep, _ in rows], dtype=torch.long),
        "truncated": torch.tensor([ep.truncated for ep, _ in rows], dtype=torch.bool),
        "num_turns": torch.tensor([ep.num_turns for ep, _ in rows], dtype=torch.long),
        "turn_index": torch.tensor([k for _, k in rows], dtype=torch.long),
    }
    return ExperienceBatch.from_sequences(tokens, seqs)


def _turn_rows(ep: Episode, gamma: float) -> list[tuple[torch.Tensor, ...]]:
    """One (input_ids, action_mask, rollout_logprobs, token_rewards) row per turn, in turn order.
    Built from the last turn backwards, so that each row's final reward can include the discounted
    return of the turns after it."""
    ends = [*ep.turn_starts[1:], len(ep.token_ids)]
    spans = []
    for start, end in zip(ep.turn_starts, ends):
        n = 0
        while start + n < end and ep.action_mask[start + n]:
            n += 1
        spans.append((start, n))
    rewards = _rewards_per_turn(ep)
    out: list[tuple[torch.Tensor, ...]] = []
    after = 0.0  # return at the first generated token of the next turn
    for k in reversed(range(len(spans))):
        start, n = spans[k]
        prompt = ep.turn_prompts[k]
        ids = torch.tensor(prompt + ep.token_ids[start:start + n], dtype=torch.long)
        mask = torch.zeros(len(ids), dtype=torch.float32)
        lps = torch.zeros(len(ids), dtype=torch.float32)
        rew = torch.zeros(len(ids), dtype=torch.float32)
        last_return = rewards[k] + gamma * after
        if n and ep.error is None:
            mask[len(prompt):] = 1.0
            lps[len(prompt):] = torch.tensor(ep.logprobs[start:start + n], dtype=torch.float32)
            rew[-1] = last_return
        after = last_return * gamma ** max(n - 1, 0)
        out.append((ids, mask, lps, rew))
    return out[::-1]


def _rewards_per_turn(ep: Episode) -> list[float]:
    """``ep.turn_rewards``; for an episode without them (or whose turn count does not match), its
    whole reward on the last turn."""
    if len(ep.turn_rewards) == len(ep.turn_starts):
        return list(ep.turn_rewards)
    return [0.0] * max(len(ep.turn_starts) - 1, 0) + [ep.reward]


def turn_token_rewards(ep: Episode, mask: torch.Tensor) -> torch.Tensor:
    """[len(ep.token_ids)]: the reward of turn ``k`` on the last generated token of turn ``k``.

    A turn that generated nothing hands its reward to the last generated token before it; an
    episode without per-turn rewards (or whose turn count does not match) gets its whole reward on
    its last generated token. A row without generated tokens (a failed episode) stays all zero.
    """
    out = torch.zeros(len(ep.token_ids), dtype=torch.float32)
    gen = mask.nonzero().squeeze(1)
    if gen.numel() == 0:
        return out
    ends = [*ep.turn_starts[1:], len(ep.token_ids)]
    for end, r in zip(ends, _rewards_per_turn(ep)):
        before = gen[gen < end]
        if before.numel():
            out[before[-1]] += r
    return out


def forward_micro_batch(model, mb: ExperienceBatch, *, temperature: float, value_head=None,
                        with_entropy: bool = False, allowed: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and values, entropy) of a micro-batch, unpadded back to [N].

    ``allowed``: the token ids the policy may generate (``--model.allowed_tokens``); log-probs and
    entropy are then over that set, as the rollout sampled them."""
    input_ids = mb.padded("input_ids", 0)  # [S, L]
    attn = (torch.arange(input_ids.shape[1])[None, :] < mb.seq_lens[:, None]).to(input_ids.device)
    need_hidden = value_head is not None
    out = model(input_ids=input_ids, attention_mask=attn.long(), output_hidden_states=need_hidden, use_cache=False)
    logits = out.logits.float()  # [S, L, V]
    allowed_t = None if allowed is None else torch.as_tensor(allowed, dtype=torch.long, device=logits.device)
    res = {"logprobs": mb.unpad(shifted_logprobs(logits, input_ids, temperature=temperature, allowed=allowed_t))}
    if with_entropy:
        res["entropy"] = mb.unpad(shifted_entropy(logits, temperature=temperature, allowed=allowed_t))
    if need_hidden:
        h = out.hidden_states[-1]  # [S, L, H]
        v = value_head(h.float()).squeeze(-1)  # [S, L]: value of the state after token t
        res["values"] = mb.unpad(torch.nn.functional.pad(v[:, :-1], (1, 0)))  # value before choosing token t
    return res


@torch.no_grad()
def fill_logprobs(model, batch: ExperienceBatch, *, name: str, temperature: float, micro_batch_tokens: int,
                  value_head=None, allowed: list[int] | None = None) -> ExperienceBatch:
    """Add per-token ``name`` log-probs (and ``values`` when a value head is given) to the batch."""
    out = {name: torch.zeros(batch.num_tokens)}
    if value_head is not None:
        out["values"] = torch.zeros(batch.num_tokens)
    for idx in batch.micro_batch_indices(micro_batch_tokens):
        mb = batch.select(idx)
        res = forward_micro_batch(model, mb, temperature=temperature, value_head=value_head, allowed=allowed)
        pos = batch.token_positions(idx)
        out[name][pos] = res["logprobs"].cpu()
        if value_head is not None:
            out["values"][pos] = res["values"].cpu()
    tokens = dict(batch.tokens)
    tokens.update(out)
    return ExperienceBatch(batch.cu_seqlens, tokens, dict(batch.seqs))


def compute_advantages(batch: ExperienceBatch, *, estimator: str, num_groups: int, grpo_scale: str,
                       gamma: float, lam: float, kl: torch.Tensor | None, kl_coef_in_reward: float,
                       moments_fn: Callable | None = None) -> ExperienceBatch:
    """Add per-token ``advantages`` (and ``returns`` for GAE).

    ``moments_fn(kind, local_moments)`` lets a distributed caller all-reduce the statistics, so the
    rewards themselves never leave their rank; by default the local batch is the whole batch.
    """
    mask = batch.padded("action_mask", 0.0)
    tokens = dict(batch.tokens)
    if estimator == "grpo":
        from earl_lightning.algorithms import grouped_moments, moments

        rewards, gids = batch.seqs["rewards"], batch.seqs["group_ids"]
        # One reward per EPISODE in the statistics, however many turn rows it was packed into.
        first = batch.seqs["turn_index"] == 0 if "turn_index" in batch.seqs else torch.ones_like(gids, dtype=torch.bool)
        group, whole = grouped_moments(rewards[first], gids[first], num_groups), moments(rewards[first])
        if moments_fn is not None:
            group, whole = moments_fn("group", group), moments_fn("batch", whole)
        adv = grpo_advantages(rewards, gids, num_groups=num_groups, scale=grpo_scale, group=group, batch=whole)
        tokens["advantages"] = adv[batch.token_seq_index()] * batch.tokens["action_mask"]
    elif estimator == "reinforce_pp":
        from earl_lightning.algorithms import moments

        r = token_rewards_padded(batch, mask, kl, kl_coef_in_reward)
        whole = None
        if moments_fn is not None:
            from earl_lightning.algorithms import discounted_returns

            whole = moments_fn("batch", moments(discounted_returns(r, mask, gamma=gamma), mask))
        adv = reinforce_pp_advantages(r, mask, gamma=gamma, batch=whole)
        tokens["advantages"] = batch.unpad(adv)
    elif estimator == "gae":
        r = token_rewards_padded(batch, mask, kl, kl_coef_in_reward)
        adv, ret = gae_advantages(r, batch.padded("values", 0.0), mask, gamma=gamma, lam=lam)
        tokens["advantages"], tokens["returns"] = batch.unpad(adv), batch.unpad(ret)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: ['grpo', 'reinforce_pp', 'gae']")
    return ExperienceBatch(batch.cu_seqlens, tokens, dict(batch.seqs))


def token_rewards_padded(batch: ExperienceBatch, mask: torch.Tensor, kl: torch.Tensor | None,
                         kl_coef: float) -> torch.Tensor:
    """[B, T] per-token rewards: the per-turn ``token_rewards`` when the batch has them, else each
    sequence's reward on its last generated token; minus the KL penalty when it is in the reward."""
    if "token_rewards" in batch.tokens:
        r = batch.padded("token_rewards", 0.0) * mask
    else:
        r = outcome_to_token_rewards(batch.seqs["rewards"], mask)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl * mask
    return r

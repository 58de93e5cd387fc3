"""Finished episodes -> a packed :class:`ExperienceBatch` (one row per episode, or per turn).

No Lightning here: this is what the training step's experience is made of, and what the
invariance tests call directly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from earl_lightning.batches.experience import ExperienceBatch, cu_seqlens_of
from earl_lightning.rollout.types import Episode


def episodes_to_experience(episodes: list[Episode], *, gamma: float = 1.0) -> ExperienceBatch:
    """Pack episodes (no padding). Failed episodes (env exception) keep their tokens but get an
    all-zero action mask: they are counted in the metrics and contribute nothing to the loss. A
    dataset row skipped as too long for the context (``error_kind == "row"``) makes no row at all:
    its prompt can be far longer than any trained sequence, and carried along with a zero mask it
    would still cost the experience and train forwards their time and memory. It stays counted
    where the episodes are (``data/skipped_rows``, ``reward/mean``); a group's advantages are
    those of its other members. An agent's episode split into rows (``row_starts``) is one row
    per part, ``turn_index`` the part's number, every part with the episode's reward.

    An episode whose turns saw the whole chat is one row; ``token_rewards`` holds each turn's
    reward on that turn's last generated token (see :func:`turn_token_rewards`), what the
    token-level estimators (REINFORCE++, GAE) discount. An episode played with a history window
    (``Episode.turn_prompts``) becomes one row per turn: that turn's prompt (mask 0) and its
    generated tokens (mask 1); its last generated token carries the turn's reward plus ``gamma``
    times the return of the turns after it (the Monte-Carlo continuation, so returns within a row
    are the episode's returns-to-go). Per-row fields: ``rewards`` (the episode's), ``group_ids``,
    ``episode_ids``, ``truncated``, ``num_turns`` and ``turn_index`` (0 for a whole-episode row).
    """
    fields = ("input_ids", "action_mask", "rollout_logprobs", "token_rewards")
    flat: dict[str, list] = {name: [] for name in fields}  # every row's values, one list per field
    lengths: list[int] = []
    total = 0  # tokens so far: where the next row starts in the flat batch
    rows: list[tuple[Episode, int]] = []
    # whole-episode rows: each turn's end in the flat batch, its reward, its row's start
    placed: list[tuple[int, float, int]] = []
    for ep in episodes:
        if ep.error_kind == "row":
            continue
        if ep.turn_prompts and len(ep.turn_prompts) == len(ep.turn_starts):
            per_row = _turn_rows(ep, gamma)
        else:
            per_row, rewards = _episode_rows(ep, gamma)
            placed += [(total + end, value, total + start) for end, value, start in rewards]
        for k, row in enumerate(per_row):
            for name, values in zip(fields, row):
                flat[name].extend(values)
            lengths.append(len(row[0]))
            total += lengths[-1]
            rows.append((ep, k))
    arrays = {
        name: np.array(flat[name], dtype=np.int64 if name == "input_ids" else np.float32)
        for name in fields
    }
    ends, values, starts = (list(x) for x in zip(*placed)) if placed else ([], [], [])
    _place_turn_rewards(arrays["token_rewards"], arrays["action_mask"], ends, values, starts)
    seqs = {
        "rewards": torch.tensor([ep.reward for ep, _ in rows], dtype=torch.float32),
        "group_ids": torch.tensor([ep.spec.group_id for ep, _ in rows], dtype=torch.long),
        "episode_ids": torch.tensor([ep.spec.episode_id for ep, _ in rows], dtype=torch.long),
        "truncated": torch.tensor([ep.truncated for ep, _ in rows], dtype=torch.bool),
        "num_turns": torch.tensor([ep.num_turns for ep, _ in rows], dtype=torch.long),
        "turn_index": torch.tensor([k for _, k in rows], dtype=torch.long),
    }
    return ExperienceBatch(
        cu_seqlens_of(lengths), {name: torch.from_numpy(a) for name, a in arrays.items()}, seqs
    )


def _episode_rows(
    ep: Episode, gamma: float
) -> tuple[list[tuple[list, list, list, list]], list[tuple[int, float, int]]]:
    """An episode that saw its whole chat: its rows (one, or one per part of an agent's episode
    split at ``row_starts``; a failed episode's mask all zero), and the rewards to place, as (end
    of the turn, reward, start of its row) relative to the episode's first token."""
    n = len(ep.token_ids)
    mask = [0] * n if ep.error is not None else ep.action_mask
    bounds = [0, *(ep.row_starts or []), n]
    ends = [*ep.turn_starts[1:], n]
    placed = [
        (end, r, _row_of(bounds, start))
        for start, end, r in zip(ep.turn_starts, ends, _rewards_per_turn(ep))
    ]
    placed += _continuations(ep, mask, bounds, gamma)
    rows = [
        (ep.token_ids[a:b], mask[a:b], ep.logprobs[a:b], [0.0] * (b - a))
        for a, b in zip(bounds, bounds[1:])
    ]
    return rows, placed


def _row_of(bounds: list[int], position: int) -> int:
    """The start of the row (``bounds``: row starts, then the end) that holds ``position``."""
    return max(b for b in bounds[:-1] if b <= position)


def _continuations(
    ep: Episode, mask: list[int], bounds: list[int], gamma: float
) -> list[tuple[int, float, int]]:
    """An episode split into rows (``row_starts``: an agent rewrote its context): each row but the
    last ends its own sequence, so its last generated token carries the return of the episode
    from there (its reward discounted by ``gamma`` per generated token after it), as a history
    window's turn rows do. (end, value, row start) per such row."""
    if len(bounds) <= 2:
        return []
    total = sum(_rewards_per_turn(ep))
    out = []
    for a, b in zip(bounds[:-2], bounds[1:-1]):
        last = next((i for i in range(b - 1, a - 1, -1) if mask[i]), None)
        if last is not None:
            after = sum(mask[last + 1 :])
            out.append((last + 1, total * gamma**after, a))
    return out


def _place_turn_rewards(
    out: np.ndarray, mask: np.ndarray, ends: list[int], values: list[float], row_starts: list[int]
) -> None:
    """Add each turn's reward (at flat end ``ends[i]``) on the last generated token before that end
    within its row (``row_starts[i]`` on), in turn order, in float32: :func:`turn_token_rewards`
    for a whole batch at once."""
    generated = np.flatnonzero(mask)
    if not ends or not generated.size:
        return
    last = np.searchsorted(generated, np.asarray(ends), side="left") - 1
    pos = generated[np.maximum(last, 0)]
    keep = (last >= 0) & (pos >= np.asarray(row_starts))
    np.add.at(out, pos[keep], np.asarray(values, dtype=np.float32)[keep])


def _turn_rows(
    ep: Episode, gamma: float
) -> list[tuple[list, list[float], list[float], list[float]]]:
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
    out = []
    after = 0.0  # return at the first generated token of the next turn
    for k in reversed(range(len(spans))):
        start, n = spans[k]
        prompt = ep.turn_prompts[k]
        ids = list(prompt) + list(ep.token_ids[start : start + n])
        mask, lps, rew = [0.0] * len(ids), [0.0] * len(ids), [0.0] * len(ids)
        last_return = rewards[k] + gamma * after
        if n and ep.error is None:
            mask[len(prompt) :] = [1.0] * n
            lps[len(prompt) :] = ep.logprobs[start : start + n]
            rew[-1] = last_return  # rounded to float32 when packed
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
    n = len(ep.token_ids)
    out = np.zeros(n, dtype=np.float32)
    rewards = _rewards_per_turn(ep)
    _place_turn_rewards(out, mask.numpy(), [*ep.turn_starts[1:], n], rewards, [0] * len(rewards))
    return torch.from_numpy(out)


class SupervisedRow(NamedTuple):
    """A row for supervised training: its token ids, its action mask (1 on the assistant's
    tokens), and ``heads``: ``(turn index, position)`` of the first generated token of each turn in
    the row."""

    input_ids: list[int]
    action_mask: list[int]
    heads: list[tuple[int, int]]


def supervised_rows(episodes: list[Episode]) -> list[list[SupervisedRow]]:
    """For each episode, the rows the trainer would make of it (one per turn with a history
    window, else one for the episode), for supervised training on them; a failed episode has
    none."""
    out: list[list[SupervisedRow]] = []
    for ep in episodes:
        if ep.error is not None:
            out.append([])
        elif ep.turn_prompts and len(ep.turn_prompts) == len(ep.turn_starts):
            rows = []
            for k, (ids, mask, _, _) in enumerate(_turn_rows(ep, 1.0)):
                n = len(ep.turn_prompts[k])
                heads = [(k, n)] if n < len(ids) else []
                rows.append(SupervisedRow(ids, [int(m) for m in mask], heads))
            out.append(rows)
        else:
            heads = [
                (k, s)
                for k, s in enumerate(ep.turn_starts)
                if s < len(ep.token_ids) and ep.action_mask[s]
            ]
            out.append([SupervisedRow(list(ep.token_ids), [int(m) for m in ep.action_mask], heads)])
    return out

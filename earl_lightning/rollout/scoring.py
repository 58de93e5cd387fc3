"""Scoring finished episodes with reward functions (TRL's signature), after the rollout.

Each episode is handed to the functions as TRL hands a completion: its prompt in the row's form
(a string, or the messages before the first assistant turn), its completion in the same form (the
text generated; or the messages after the prompt: assistant turns and the environment's replies,
the whole transcript), the token ids after the prompt, and the row's other columns. The weighted
sum of the values (None: not applicable) is added to the episode's reward and to its last turn's.

An episode that a function could not score (it raised, or ran past its time limit) fails
(``error_kind="reward"``; it keeps its tokens and trains on nothing, like an environment
failure); a row without an environment that no function scored is ``unscored`` and dropped the
same way (TRL gives it advantage 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from earl_lightning.rollout.types import Episode
from earl_lightning.tasks.rewards import (
    NOT_COLUMNS,
    RewardFunction,
    RewardOutcome,
    call_reward_funcs,
)


def is_raw(ep: Episode) -> bool:
    """A standard-form (string) prompt played without an environment: plain text, no chat template."""
    return (
        ep.spec.row is not None
        and ep.spec.env is None
        and isinstance(ep.spec.row.get("prompt"), str)
    )


def transcript(ep: Episode, tokenizer: Any) -> tuple[Any, Any, list[int]]:
    """(prompt, completion, completion ids) of ``ep`` in TRL's form."""
    ids = list(ep.token_ids[ep.prompt_tokens :])
    if ep.from_agent:
        return _agent_transcript(ep, ids)
    if is_raw(ep):
        return ep.spec.row["prompt"], tokenizer.decode(ids, skip_special_tokens=True), ids
    first = next(
        (i for i, m in enumerate(ep.messages) if m["role"] == "assistant"), len(ep.messages)
    )
    if ep.spec.row is not None and isinstance(ep.spec.row.get("prompt"), str):
        return ep.spec.row["prompt"], tokenizer.decode(ids, skip_special_tokens=False), ids
    return (
        [dict(m) for m in ep.messages[:first]],
        _with_calls(ep.messages[first:], ep.turn_calls),
        ids,
    )


def _agent_transcript(ep: Episode, ids: list[int]) -> tuple[Any, Any, list[int]]:
    """An agent's episode: the row's prompt, and what followed the agent's first messages (the
    conversation as it last sent it, and the last response); a string prompt gets the last
    response's text, as TRL gives a standard-form completion."""
    first = next(
        (i for i, m in enumerate(ep.messages) if m["role"] == "assistant"), len(ep.messages)
    )
    prompt = (ep.spec.row or {}).get("prompt", [dict(m) for m in ep.messages[:first]])
    if isinstance(prompt, str):
        last = ep.messages[-1] if ep.messages and ep.messages[-1]["role"] == "assistant" else {}
        return prompt, last.get("content") or "", ids
    return prompt, [dict(m) for m in ep.messages[first:]], ids


def _with_calls(messages: list[dict], turn_calls: list[list]) -> list[dict]:
    """The messages in TRL's form: an assistant turn that called tools carries them as
    ``tool_calls`` (its ``content`` is the text the model wrote, the calls included)."""
    out, turn = [], 0
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            calls = turn_calls[turn] if turn < len(turn_calls) else []
            if calls:
                m["tool_calls"] = [c.as_message() for c in calls]
            turn += 1
        out.append(m)
    return out


def score_episodes(
    episodes: Sequence[Episode],
    funcs: Sequence[RewardFunction],
    tokenizer: Any,
    extras: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> list[RewardOutcome]:
    """Score ``episodes`` in place (see the module docstring); the functions' outcomes on the
    episodes that were scored (those that did not fail in their environment), in order. A function
    still running ``timeout_s`` after it started fails the episodes it has not scored, as one that
    raises does (:func:`~earl_lightning.tasks.rewards.call_reward_funcs`; None: no limit)."""
    scored = [ep for ep in episodes if ep.error is None]
    if not funcs or not scored:
        return []
    prompts, completions, ids = map(list, zip(*(transcript(ep, tokenizer) for ep in scored)))
    keys = sorted({k for ep in scored for k in (ep.spec.row or {}) if k not in NOT_COLUMNS})
    columns = {k: [(ep.spec.row or {}).get(k) for ep in scored] for k in keys}
    outcomes = call_reward_funcs(funcs, prompts, completions, ids, columns, extras, timeout_s)
    for j, ep in enumerate(scored):
        _apply(ep, funcs, [o.values[j] for o in outcomes], [o.errors[j] for o in outcomes])
        for o in outcomes:
            for column, values in o.extra.items():
                if j < len(values):
                    ep.info.setdefault("log_extra", {})[column] = values[j]
    return outcomes


def _apply(
    ep: Episode,
    funcs: Sequence[RewardFunction],
    values: list[float | None],
    errors: list[str | None],
) -> None:
    ep.rewards = {f.name: v for f, v in zip(funcs, values)}
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        _drop(ep, failed, "reward")
        return
    if all(v is None for v in values) and ep.spec.env is None and ep.agent_reward is None:
        _drop(
            ep, "no reward function returned a value for this row (each returned None)", "unscored"
        )
        return
    total = sum(f.weight * v for f, v in zip(funcs, values) if v is not None)
    ep.reward += total
    if ep.turn_rewards:
        ep.turn_rewards[-1] += total


def _drop(ep: Episode, why: str, kind: str) -> None:
    ep.error, ep.error_kind, ep.reward = why, kind, 0.0
    ep.turn_rewards = [0.0] * len(ep.turn_rewards)

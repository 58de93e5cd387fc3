"""What a rollout is asked to play (:class:`EpisodeSpec`) and what it returns (:class:`Episode`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EpisodeSpec:
    """One episode to play: environment name, its reset seed, and the ids the trainer groups by.

    ``episode_id`` must be unique within one :func:`~earl_lightning.rollout.loop.rollout` call: it is
    the generation backend's request key (KV cache slot) for the whole episode.

    ``row``: a dataset row (its ``prompt`` and every other column) the episode starts from, or None
    for an environment's own first observation (``reset(seed)``). A row with ``env`` None is one
    turn; with an environment, ``reset(seed, **columns)`` starts the episode from the row's prompt.
    ``row_index``: the row's index in its split (-1 without a row).
    """

    env: str | None
    seed: int
    group_id: int
    episode_id: int
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    row_index: int = -1


@dataclass
class Episode:
    """A finished episode as one token sequence in chat form.

    ``token_ids``, ``action_mask`` and ``logprobs`` have the same length; ``action_mask[t] == 1``
    iff the policy generated ``token_ids[t]``, and ``logprobs[t]`` is that token's sampled
    log-prob (0.0 where the mask is 0). ``turn_starts[k]`` is the index of the first generated
    token of assistant turn ``k``. ``messages`` is the chat transcript the tokens render: the
    chat template applied to it gives exactly ``token_ids`` (for tokenizers whose encoding of the
    generated text round-trips). ``info`` is what the env's last ``step`` returned as ``info``
    (e.g. the calculator's ``correct`` and ``tool_calls``).

    ``prompt_tokens`` is the length of the first prompt (what the reward functions' completion ids
    follow); ``rewards`` holds each reward function's value (None: not applicable, or not scored);
    ``error_kind`` says where ``error`` arose: ``env`` (an environment call), ``reward`` (a
    reward function; the environment's own part of the episode went fine), ``unscored`` (no
    reward function scored the row) or ``row`` (a dataset row too long for the context: skipped,
    never trained on). ``tool_calls``, ``tool_errors``, ``tool_seconds`` and ``tool_truncated``
    (results cut to the result budget) count the episode's tool use; ``turn_calls[k]`` are the
    calls turn ``k`` made (its assistant message in ``messages`` holds the text the model wrote).

    An episode played by a user's agent (``from_agent``) is the calls it made to the endpoint:
    ``messages`` is the conversation as the agent last sent it plus the last response (tool calls
    as OpenAI ``tool_calls``), and ``row_starts`` (when the agent rewrote its context) splits the
    tokens into the rows the trainer learns from, each its own sequence with the episode's reward.
    """

    spec: EpisodeSpec
    token_ids: list[int]
    action_mask: list[int]
    logprobs: list[float]
    reward: float
    num_turns: int
    done: bool
    truncated: bool
    invalid_action: bool
    outcome: str | None
    error: str | None
    turn_starts: list[int]
    messages: list[dict[str, str]]
    turn_rewards: list[float] = field(default_factory=list)
    turn_prompts: list[list[int]] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # the env's ``info`` of the last step
    prompt_tokens: int = 0
    rewards: dict[str, float | None] = field(default_factory=dict)
    error_kind: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    tool_truncated: int = 0
    # each turn's parsed tool calls (ToolCall)
    turn_calls: list[list[Any]] = field(default_factory=list)
    # an agent's episode whose calls rewrote the context: where each row after the first starts
    row_starts: list[int] | None = None
    from_agent: bool = False  # played by a user's agent through the endpoint
    agent_reward: float | None = None  # what the agent returned (None: reward functions score it)

    @property
    def num_generated(self) -> int:
        return sum(self.action_mask)

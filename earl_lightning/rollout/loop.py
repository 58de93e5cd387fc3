"""The multi-turn rollout loop: batched generation over all live episodes, then one env step each.

Each episode is one token sequence in chat form, exactly what the tokenizer's chat template gives
for its transcript: [system] user(obs_0) <gen prompt> assistant(gen_1) <end> user(obs_1) <gen
prompt> assistant(gen_2) <end> ... Generated tokens carry mask 1 and their sampled log-probs;
everything else (observations, chat scaffolding, and the end-of-turn text the loop appends when a
turn stopped without eos) carries mask 0.

With ``history_turns=k`` the policy sees a bounded window instead of the whole chat: each turn is
generated from [system] + the last ``k`` exchanges + the current observation (verl-agent's
``history_length``; ``k = 0``: the current observation only). The episode's sequence is still the
whole chat (for transcripts and metrics), and ``Episode.turn_prompts`` records the prompt each turn
was generated from: the trainer then learns from one row per turn (data/episodes.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from earl_lightning.envs.base import Env
from earl_lightning.rollout.backends.base import GenerationBackend, GenOutput, GenRequest, SamplingConfig
from earl_lightning.rollout.chat import ChatDeltas, Messages
from earl_lightning.rollout.env_calls import EnvCalls, EnvFault
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.tasks.rows import first_messages


@dataclass
class _Live:
    """An episode being played."""

    spec: EpisodeSpec
    env: Env | None
    messages: Messages
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_prompts: list[list[int]] | None = None
    next_prompt: list[int] | None = None  # the windowed prompt of the next turn (history_turns only)
    raw: bool = False  # a standard-form (string) prompt without an environment: plain text, no chat template
    prompt_tokens: int = 0
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    invalid_action: bool = False
    outcome: str | None = None
    error: str | None = None
    error_kind: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.done or self.truncated

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.action_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fail(self, fault: EnvFault, kind: str = "env") -> None:
        self.error, self.error_kind, self.done, self.reward = str(fault), kind, True, 0.0
        self.env = None  # never called again (after a time-out, its call may still be running)
        self.turn_rewards = [0.0] * len(self.turn_starts)

    def to_episode(self) -> Episode:
        return Episode(
            spec=self.spec, token_ids=self.token_ids, action_mask=self.action_mask, logprobs=self.logprobs,
            reward=self.reward, num_turns=len(self.turn_starts), done=self.done, truncated=self.truncated,
            invalid_action=self.invalid_action, outcome=self.outcome, error=self.error,
            turn_starts=self.turn_starts, messages=self.messages, turn_rewards=self.turn_rewards,
            turn_prompts=self.turn_prompts, info=self.info, prompt_tokens=self.prompt_tokens,
            error_kind=self.error_kind,
        )

    def prompt(self) -> list[int]:
        """What the next turn is generated from: the whole chat, or its windowed prompt."""
        return self.token_ids if self.next_prompt is None else self.next_prompt


def rollout(
    specs: list[EpisodeSpec],
    backend: GenerationBackend,
    tokenizer: Any,
    sampling: SamplingConfig,
    *,
    max_turns: int,
    max_context_tokens: int,
    system_prompt: str | None = None,
    history_turns: int | None = None,
    env_timeout_s: float | None = None,
) -> list[Episode]:
    """Play every episode of ``specs`` to the end, in lock-step turns; episodes in spec order.

    An episode ends when its env says done, after ``max_turns`` turns (``truncated``), or when
    the next turn would not fit: ``len(context + next observation) + max_new_tokens >
    max_context_tokens`` (``truncated``; with ``history_turns``, when the next windowed prompt +
    ``max_new_tokens`` would not fit). A fault in an environment call (building the env,
    ``reset``, ``step``) ends only that episode: an exception, a return value of the wrong type,
    or a call still running after ``env_timeout_s`` seconds (None: no limit, and no threads) sets
    ``error`` (naming the env, seed, call and problem), ``done`` and reward 0.0; see
    :mod:`earl_lightning.rollout.env_calls`.

    Raises:
        ValueError: bad ``max_turns`` / ``max_context_tokens`` / ``history_turns`` / duplicate
            episode ids, or a first observation that does not fit in ``max_context_tokens``.
    """
    _check_args(specs, max_turns, max_context_tokens)
    check_history_turns(history_turns, "history_turns")
    chat = ChatDeltas(tokenizer)
    keys = [s.episode_id for s in specs]
    calls = EnvCalls(env_timeout_s)
    backend.release(keys)  # a stale cache from an earlier rollout (older weights) must not be reused
    try:
        states = [_start(spec, calls, chat, system_prompt, history_turns) for spec in specs]
        for st in states:
            if st.raw:
                st.append(raw_prompt_ids(tokenizer, st.messages[0]["content"]), 0)
            st.prompt_tokens = len(st.token_ids)
        for st in states:
            _check_first_fit(st, sampling.max_new_tokens, max_context_tokens)
        for turn in range(max_turns):
            live = [st for st in states if not st.finished]
            if not live:
                break
            outputs = backend.generate([GenRequest(st.spec.episode_id, st.prompt(), st.messages[-1]["content"])
                                        for st in live], sampling)
            for st, out in zip(live, outputs):
                _play_turn(st, out, calls, chat, tokenizer, last_turn=turn == max_turns - 1,
                           budget=max_context_tokens - sampling.max_new_tokens, history_turns=history_turns)
            backend.release([st.spec.episode_id for st in live if st.finished])
        return [st.to_episode() for st in states]
    finally:
        calls.close()
        backend.release(keys)


def _check_args(specs: list[EpisodeSpec], max_turns: int, max_context_tokens: int) -> None:
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"`max_turns` must be an integer >= 1, got {max_turns!r}")
    if isinstance(max_context_tokens, bool) or not isinstance(max_context_tokens, int) or max_context_tokens < 1:
        raise ValueError(f"`max_context_tokens` must be an integer >= 1, got {max_context_tokens!r}")
    ids = [s.episode_id for s in specs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"`specs` must have unique `episode_id`s (they key the KV cache); duplicated: {dup[:8]}")


def check_history_turns(value: int | None, arg: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"`{arg}` must be None (the whole chat) or an integer >= 0 (past exchanges kept in each "
                         f"turn's prompt), got {value!r}")


def _window(messages: Messages, history_turns: int) -> Messages:
    """[system] + the last ``history_turns`` (user, assistant) exchanges + the last (user) message."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    return head + messages[len(head):][-(2 * history_turns + 1):]


def first_prompt_ids(spec: EpisodeSpec, tokenizer: Any, system_prompt: str | None = None) -> list[int]:
    """The ids the first turn of ``spec`` is generated from, built as :func:`rollout` builds them
    (its env is built and reset). Raises :class:`EnvFault` when that fails."""
    calls = EnvCalls(None)
    try:
        st = _start(spec, calls, ChatDeltas(tokenizer), system_prompt, None)
    finally:
        calls.close()
    if st.error is not None:
        raise EnvFault(st.error)
    return raw_prompt_ids(tokenizer, st.messages[0]["content"]) if st.raw else list(st.token_ids)


def raw_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A standard-form prompt's ids: the text as the tokenizer encodes it (with its BOS, if it adds
    one), no chat template, as TRL tokenizes a standard prompt."""
    return list(tokenizer(text)["input_ids"])


def _start(spec: EpisodeSpec, calls: EnvCalls, chat: ChatDeltas, system_prompt: str | None,
           history_turns: int | None) -> _Live:
    """Build the env, reset it and encode the first prompt; a fault there fails the episode.

    The first chat is the env's first observation as a user message, or the row's prompt (with what
    the env's reset returned added to its last message). A standard-form (string) prompt without
    an environment is plain text (``raw``: the caller encodes it, no chat template)."""
    st = _Live(spec, None, [])
    if history_turns is not None:
        st.turn_prompts = []
    try:
        st.env, observation = calls.start(spec)
    except EnvFault as fault:
        st.fail(fault)
        return st
    if spec.row is None:
        st.messages = first_messages(observation, system_prompt)
    elif spec.env is None and isinstance(spec.row["prompt"], str):
        st.raw, st.messages = True, [{"role": "user", "content": spec.row["prompt"]}]
        return st
    else:
        st.messages = first_messages(spec.row["prompt"], system_prompt, observation)
    st.append(chat.encode(chat.prompt(st.messages)), 0)
    if history_turns is not None:
        st.next_prompt = list(st.token_ids)  # nothing to window yet
    return st


def _check_first_fit(st: _Live, max_new_tokens: int, max_context_tokens: int) -> None:
    """A first prompt too long for ``max_context_tokens`` is a configuration error for an env's own
    first observation; a dataset row that is too long is skipped (its episode fails as ``row``)."""
    if st.finished:
        return
    need = len(st.token_ids) + max_new_tokens
    if need > max_context_tokens and st.spec.row is not None:
        st.fail(EnvFault(f"row {st.spec.row_index}: its prompt is {len(st.token_ids)} tokens, which with "
                         f"{max_new_tokens} max_new_tokens exceeds max_context_tokens={max_context_tokens}; the row "
                         f"is skipped"), kind="row")
    elif need > max_context_tokens:
        raise ValueError(
            f"`max_context_tokens`={max_context_tokens} is too small: the first prompt of episode "
            f"{st.spec.episode_id} (env {st.spec.env!r}) needs {need} tokens ({len(st.token_ids)} prompt "
            f"+ {max_new_tokens} max_new_tokens)"
        )


def _play_turn(st: _Live, out: GenOutput, calls: EnvCalls, chat: ChatDeltas, tokenizer: Any, *, last_turn: bool,
               budget: int, history_turns: int | None = None) -> None:
    """Append one assistant turn, step the env, then either close the episode or append the next
    observation. ``budget`` is the longest context a next turn may start from."""
    content, closing = _assistant_text(st.messages, out, chat, tokenizer, st.raw)
    if st.turn_prompts is not None:
        st.turn_prompts.append(st.prompt())
    st.turn_starts.append(len(st.token_ids))
    st.append(list(out.token_ids), 1, [float(x) for x in out.logprobs])
    st.append(chat.encode(closing), 0)
    st.messages.append({"role": "assistant", "content": content})
    if st.spec.env is None:  # a row without an environment is one turn; reward functions score it
        st.turn_rewards.append(0.0)
        st.done = True
        return
    try:
        result = calls.step(st.spec, st.env, content)  # checked: reward a float, done a bool, info a dict
    except EnvFault as fault:
        st.fail(fault)
        return
    st.reward += result.reward
    st.turn_rewards.append(result.reward)
    st.invalid_action |= bool(result.info.get("invalid_action", False))
    st.outcome = result.info.get("outcome", st.outcome)
    st.info = dict(result.info)
    if result.done:
        st.done = True
        return
    if last_turn:
        st.truncated = True
        return
    nxt = chat.encode(chat.next_user(st.messages, result.observation))
    user = {"role": "user", "content": result.observation}
    if history_turns is None:
        if len(st.token_ids) + len(nxt) > budget:
            st.truncated = True
            return
    else:
        prompt = chat.encode(chat.prompt(_window([*st.messages, user], history_turns)))
        if len(prompt) > budget:
            st.truncated = True
            return
        st.next_prompt = prompt
    st.messages.append(user)
    st.append(nxt, 0)


def _assistant_text(messages: Messages, out: GenOutput, chat: ChatDeltas, tokenizer: Any,
                    raw: bool = False) -> tuple[str, str]:
    """The assistant message content and the mask-0 text that closes the turn (none for a
    ``raw`` text prompt: the completion is all there is).

    When the turn ended with eos and the template's end-of-turn text starts with the eos text
    (ChatML's ``<|im_end|>``), the sampled eos already is that text, so only the rest (``\\n``)
    is appended; otherwise (length or stop-string finish) the whole end-of-turn text is.
    """
    ids = list(out.token_ids)
    eos_id = tokenizer.eos_token_id
    ended_eos = bool(ids) and ids[-1] == eos_id
    content = tokenizer.decode(ids[:-1] if ended_eos else ids, skip_special_tokens=False)
    if raw:
        return content, ""
    end = chat.end_of_turn(messages, content)
    if ended_eos:
        eos_text = tokenizer.decode([eos_id], skip_special_tokens=False)
        if end.startswith(eos_text):
            return content, end[len(eos_text):]
    return content, end

"""The multi-turn rollout loop: batched generation over the live episodes, then their calls.

Each episode is one token sequence in chat form, exactly what the tokenizer's chat template gives
for its transcript: [system] user(obs_0) <gen prompt> assistant(gen_1) <end> user(obs_1) <gen
prompt> assistant(gen_2) <end> ... Generated tokens carry mask 1 and their sampled log-probs;
everything else (observations, tool results, chat scaffolding, and the end-of-turn text the loop
appends when a turn stopped without eos) carries mask 0.

A turn either calls tools (the parser finds calls in the model's own format: their results come
back as ``tool`` messages and the episode goes on) or is the environment's action (``step``), or,
for a row without an environment, ends the episode. The calls of all live episodes run at the same
time (:mod:`earl_lightning.rollout.env_calls`). With ``continuous`` turns an episode whose calls
have returned joins the next generation batch without waiting for the others' calls (the sampling
of a row depends only on its own seed, key and position, so the tokens do not depend on the batch
it lands in); without, every turn waits for every call (lock-step: what tensor-parallel peers need,
since they must generate the same batches).

With ``history_turns=k`` the policy sees a bounded window instead of the whole chat: each turn is
generated from [system] + the last ``k`` exchanges + the current observation (verl-agent's
``history_length``; ``k = 0``: the current observation only). The episode's sequence is still the
whole chat (for transcripts and metrics), and ``Episode.turn_prompts`` records the prompt each turn
was generated from: the trainer then learns from one row per turn (batches/episodes.py). A chat
template that rewrites earlier turns (Qwen3's drops earlier reasoning) gets the same treatment from
the turn it first rewrites: each turn is generated from the template's whole render and is its own
row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from earl_lightning.core.checks import check_count, is_int
from earl_lightning.envs.base import ToolEnv
from earl_lightning.rollout.backends.base import GenerationBackend, GenRequest, SamplingConfig
from earl_lightning.rollout.call_pool import Pending
from earl_lightning.rollout.chat import ChatDeltas
from earl_lightning.rollout.env_calls import DEFAULT_WORKERS, EnvCalls, EnvFault
from earl_lightning.rollout.turns import LiveEpisode, TurnLimits
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.tasks.rows import first_messages
from earl_lightning.tasks.tool_parsers import ParsedTurn, ToolParser
from earl_lightning.tasks.tools import Tool, ToolSet, shown_schema, tool_of


@dataclass(frozen=True)
class ToolUse:
    """Tools in a rollout: the task's tools (an environment may add its own: :class:`ToolEnv`), the
    parser that reads calls in the model's format, the longest arguments a call may have (as JSON
    text; a longer call is an error message) and the characters of a tool result kept before it
    is tokenized (None: no cap)."""

    parser: ToolParser
    tools: tuple[Tool, ...] = ()
    schema: str = "full"  # how the prompt renders the tools' schemas (tasks/tools.py: shown_schema)
    max_argument_chars: int | None = None
    max_result_chars: int | None = None


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
    tools: ToolUse | None = None,
    call_workers: int = DEFAULT_WORKERS,
    call_isolation: str = "thread",
    continuous: bool = False,
) -> list[Episode]:
    """Play every episode of ``specs`` to the end; episodes in spec order.

    An episode ends when its env says done (or, without an env, when a turn calls no tool), after
    ``max_turns`` turns (``truncated``), or when the next turn would not fit: ``len(context + what
    comes next) + max_new_tokens > max_context_tokens`` (``truncated``; with ``history_turns``,
    when the next windowed prompt + ``max_new_tokens`` would not fit). A fault in an environment
    call (building the env, ``reset``, ``step``) ends only that episode: an exception, a return
    value of the wrong type, or a call still running after ``env_timeout_s`` seconds sets ``error``
    (naming the env, seed, call and problem), ``done`` and reward 0.0; a tool call's fault is the
    ``tool`` message the model reads next. ``call_workers`` threads run the calls; with
    ``call_isolation="process"`` each episode's environment and task tools live in a process of
    their own, killed when a call of it runs past ``env_timeout_s``.

    Raises:
        ValueError: bad ``max_turns`` / ``max_context_tokens`` / ``history_turns`` / duplicate
            episode ids, or a first observation that does not fit in ``max_context_tokens``.
    """
    _check_args(specs, max_turns, max_context_tokens, history_turns)
    keys = [s.episode_id for s in specs]
    calls = EnvCalls(
        env_timeout_s, call_workers, call_isolation, tools.tools if tools is not None else ()
    )
    # a stale cache from an earlier rollout (older weights) must not be reused
    backend.release(keys)
    try:
        states = start_episodes(specs, calls, tokenizer, system_prompt, history_turns, tools)
        for st in states:
            _check_first_fit(st, sampling.max_new_tokens, max_context_tokens)
        limits = TurnLimits(
            max_turns,
            max_context_tokens - sampling.max_new_tokens,
            history_turns,
            tools.max_argument_chars if tools is not None else None,
            tools.max_result_chars if tools is not None else None,
        )
        play = _play_continuous if continuous else _play_lockstep
        parser = tools.parser if tools is not None else None
        play(states, backend, sampling, calls, tokenizer, limits, parser)
        return [st.to_episode() for st in states]
    finally:
        calls.close()
        backend.release(keys)


def _request(st: LiveEpisode) -> GenRequest:
    return GenRequest(st.spec.episode_id, st.prompt(), st.messages[-1]["content"])


def _play_lockstep(
    states: list[LiveEpisode],
    backend: GenerationBackend,
    sampling: SamplingConfig,
    calls: EnvCalls,
    tokenizer: Any,
    limits: TurnLimits,
    parser: ToolParser | None,
) -> None:
    """Every turn: generate for all live episodes, then run all their calls, then apply them."""
    while live := [st for st in states if not st.finished]:
        outputs = backend.generate([_request(st) for st in live], sampling)
        pending = [
            (st, _submit(st, st.record(out, tokenizer, parser, limits), calls))
            for st, out in zip(live, outputs)
        ]
        calls.wait([p for _, (p, _) in pending if p is not None])
        for st, (p, action) in pending:
            _apply(st, p, action, limits)
        backend.release([st.spec.episode_id for st in live if st.finished])


def _play_continuous(
    states: list[LiveEpisode],
    backend: GenerationBackend,
    sampling: SamplingConfig,
    calls: EnvCalls,
    tokenizer: Any,
    limits: TurnLimits,
    parser: ToolParser | None,
) -> None:
    """Generate for the episodes that are ready while the others' calls run; the episodes whose
    calls have come back (at least one: waited for) make the next batch."""
    ready = [st for st in states if not st.finished]
    flying: list[tuple[LiveEpisode, Pending, Any]] = []
    while ready or flying:
        if ready:
            outputs = backend.generate([_request(st) for st in ready], sampling)
            for st, out in zip(ready, outputs):
                pending, action = _submit(st, st.record(out, tokenizer, parser, limits), calls)
                if pending is None:
                    _apply(st, None, action, limits)
                else:
                    flying.append((st, pending, action))
            backend.release([st.spec.episode_id for st in ready if st.finished])
        if not flying:
            return
        calls.wait([p for _, p, _ in flying], first=True)
        landed, flying = [f for f in flying if f[1].done], [f for f in flying if not f[1].done]
        ready = []
        for st, pending, action in landed:
            _apply(st, pending, action, limits)
            if st.finished:
                backend.release([st.spec.episode_id])
            else:
                ready.append(st)


def _submit(
    st: LiveEpisode, action: ParsedTurn | str | None, calls: EnvCalls
) -> tuple[Pending | None, Any]:
    """The calls of ``st``'s turn, in flight (None: the turn called nothing)."""
    if isinstance(action, ParsedTurn):
        return calls.submit_tools(st.tools, action.calls), action
    if isinstance(action, str):
        return calls.submit_step(st.spec, st.env, action), action
    return None, action


def _apply(st: LiveEpisode, pending: Pending | None, action: Any, limits: TurnLimits) -> None:
    if isinstance(action, ParsedTurn):
        st.apply_tools(action, pending.result(), limits)
    elif isinstance(action, str):
        st.apply_step(pending.result(), limits)


def _check_args(
    specs: list[EpisodeSpec], max_turns: int, max_context_tokens: int, history_turns: int | None
) -> None:
    check_count("max_turns", max_turns)
    check_count("max_context_tokens", max_context_tokens)
    ids = [s.episode_id for s in specs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(
            f"`specs` must have unique `episode_id`s (they key the KV cache); duplicated: {dup[:8]}"
        )
    check_history_turns(history_turns, "history_turns")


def check_history_turns(value: int | None, arg: str) -> None:
    if value is not None and not (is_int(value) and value >= 0):
        raise ValueError(
            f"`{arg}` must be None (the whole chat) or an integer >= 0 (past exchanges kept in each "
            f"turn's prompt), got {value!r}"
        )


def start_episodes(
    specs: Sequence[EpisodeSpec],
    calls: EnvCalls,
    tokenizer: Any,
    system_prompt: str | None,
    history_turns: int | None,
    tools: ToolUse | None,
    on_fault: Callable[[EnvFault], None] | None = None,
) -> list[LiveEpisode]:
    """Build and reset every spec's env (at the same time) and encode each first prompt; a fault
    there fails that episode.

    The first chat is the env's first observation as a user message, or the row's prompt (with what
    the env's reset returned added to its last message). A standard-form (string) prompt without
    an environment is plain text (``raw``: no chat template). An episode's tools are the task's and
    its environment's (:class:`ToolEnv`), rendered into every turn's prompt."""
    chats: dict[tuple, ChatDeltas] = {}
    states = []
    for spec, started in zip(specs, calls.start_all(specs)):
        st = LiveEpisode(spec, None, [])
        if history_turns is not None:
            st.turn_prompts = []
        if isinstance(started, EnvFault):
            st.chat = ChatDeltas(tokenizer)
            st.fail(started)
            if on_fault is not None:
                on_fault(started)
            states.append(st)
            continue
        st.env, observation = started
        st.tools = _toolset(tools, st.env, calls.tools_for(spec))
        schemas = (
            [shown_schema(s, tools.schema) for s in st.tools.schemas]
            if st.tools is not None
            else None
        )
        key = tuple(s["function"]["name"] for s in schemas or ())
        st.chat = chats.setdefault(key, ChatDeltas(tokenizer, schemas))
        if spec.row is None:
            st.messages = first_messages(observation, system_prompt)
        elif spec.env is None and isinstance(spec.row["prompt"], str):
            st.raw, st.messages = True, [{"role": "user", "content": spec.row["prompt"]}]
        else:
            st.messages = first_messages(spec.row["prompt"], system_prompt, observation)
        st.append(
            raw_prompt_ids(tokenizer, spec.row["prompt"])
            if st.raw
            else st.chat.encode(st.chat.prompt(st.messages)),
            0,
        )
        st.prompt_tokens = len(st.token_ids)
        if history_turns is not None:
            st.next_prompt = list(st.token_ids)  # nothing to window yet
        states.append(st)
    return states


def _toolset(tools: ToolUse | None, env: Any, task: list[Tool]) -> ToolSet | None:
    """The episode's tools: the task's (``task``: where they run for this episode), then its
    environment's (a :class:`ToolEnv`)."""
    if tools is None:
        return None
    own = (
        [tool_of(t, "the environment's tools") for t in env.tools()]
        if isinstance(env, ToolEnv)
        else []
    )
    return ToolSet([*task, *own]) if task or own else None


def first_prompt_ids(
    spec: EpisodeSpec,
    tokenizer: Any,
    system_prompt: str | None = None,
    tools: ToolUse | None = None,
) -> list[int]:
    """The ids the first turn of ``spec`` is generated from, built as :func:`rollout` builds them
    (its env is built and reset, its tools rendered). Raises :class:`EnvFault` when that fails, and
    ValueError when the env offers tools and ``tools`` is None (no parser would read the calls)."""
    calls, faults = EnvCalls(None, workers=1, log_faults=False), []
    try:
        (st,) = start_episodes([spec], calls, tokenizer, system_prompt, None, tools, faults.append)
    finally:
        calls.close()
    if st.error is not None:
        raise faults[0] if faults else EnvFault(st.error)
    if tools is None and isinstance(st.env, ToolEnv) and st.env.tools():
        names = [tool_of(t, "the environment's tools").name for t in st.env.tools()]
        raise ValueError(
            f"`--data.env` {spec.env!r} offers tools {names}, and `--model.rollout.tool_parser` is null: "
            f"set the parser of the model's tool-call format (hermes, llama3_json, mistral)"
        )
    return list(st.token_ids)


def raw_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A standard-form prompt's ids: the text as the tokenizer encodes it (with its BOS, if it adds
    one), no chat template, as TRL tokenizes a standard prompt."""
    return list(tokenizer(text)["input_ids"])


def _check_first_fit(st: LiveEpisode, max_new_tokens: int, max_context_tokens: int) -> None:
    """A first prompt too long for ``max_context_tokens`` is a configuration error for an env's own
    first observation; a dataset row that is too long is skipped (its episode fails as ``row``)."""
    if st.finished:
        return
    need = len(st.token_ids) + max_new_tokens
    if need > max_context_tokens and st.spec.row is not None:
        st.fail(
            EnvFault(
                f"row {st.spec.row_index}: its prompt is {len(st.token_ids)} tokens, which with "
                f"{max_new_tokens} max_new_tokens exceeds max_context_tokens={max_context_tokens}; the row "
                f"is skipped"
            ),
            kind="row",
        )
    elif need > max_context_tokens:
        raise ValueError(
            f"`max_context_tokens`={max_context_tokens} is too small: the first prompt of episode "
            f"{st.spec.episode_id} (env {st.spec.env!r}) needs {need} tokens ({len(st.token_ids)} prompt "
            f"+ {max_new_tokens} max_new_tokens)"
        )

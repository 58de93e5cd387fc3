"""One episode being played: its token sequence in chat form, and what each turn does to it.

A turn is recorded in two halves around the calls it makes, so that the calls of all live
episodes can run at the same time (:mod:`earl_lightning.rollout.loop`): :meth:`LiveEpisode.record`
appends the generated tokens and returns what to call next (the turn's tool calls, or one
environment step, or nothing when the episode is over); :meth:`LiveEpisode.apply_tools` /
:meth:`LiveEpisode.apply_step` append what came back and decide whether the episode goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from earl_lightning.envs.base import Env, StepResult
from earl_lightning.rollout.backends.base import GenOutput
from earl_lightning.rollout.chat import ChatDeltas, Messages, NotAppendOnly
from earl_lightning.rollout.env_calls import EnvFault
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.tasks.tool_parsers import ParsedTurn, ToolParser, read_calls
from earl_lightning.tasks.tools import ToolCall, ToolResult, ToolSet, ToolStats


@dataclass
class TurnLimits:
    """What bounds a turn: the episode's turns, the longest context a next turn may start from,
    the history window (None: the whole chat), the longest arguments a tool call may have (as JSON
    text) and the characters of a tool result that are kept (None: no cap)."""

    max_turns: int
    budget: int
    history_turns: int | None = None
    max_argument_chars: int | None = None
    max_result_chars: int | None = None


@dataclass
class LiveEpisode:
    """An episode being played."""

    spec: EpisodeSpec
    env: Env | None
    messages: Messages
    chat: ChatDeltas | None = None  # renders this episode's chat (with its tools)
    tools: ToolSet | None = None
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_prompts: list[list[int]] | None = None
    # the next turn's own prompt (history window, or a rewriting template)
    next_prompt: list[int] | None = None
    raw: bool = False  # a standard-form (string) prompt without an environment: plain text, no chat template
    rewrites: bool = False  # the chat template rewrote an earlier turn: each turn is generated from its own render
    prompt_tokens: int = 0
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    invalid_action: bool = False
    outcome: str | None = None
    error: str | None = None
    error_kind: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    tool_stats: ToolStats = field(default_factory=ToolStats)

    @property
    def finished(self) -> bool:
        return self.done or self.truncated

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.action_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fail(self, fault: EnvFault, kind: str = "env") -> None:
        self.error, self.error_kind, self.done, self.reward = str(fault), kind, True, 0.0
        self.env = None  # never called again (after a time-out, its call may still be running)
        self.turn_rewards = [0.0] * len(self.turn_starts)

    def prompt(self) -> list[int]:
        """What the next turn is generated from: the whole chat, or the turn's own prompt."""
        return self.token_ids if self.next_prompt is None else self.next_prompt

    def to_episode(self) -> Episode:
        return Episode(
            spec=self.spec,
            token_ids=self.token_ids,
            action_mask=self.action_mask,
            logprobs=self.logprobs,
            reward=self.reward,
            num_turns=self.num_turns,
            done=self.done,
            truncated=self.truncated,
            invalid_action=self.invalid_action,
            outcome=self.outcome,
            error=self.error,
            turn_starts=self.turn_starts,
            messages=self.messages,
            turn_rewards=self.turn_rewards,
            turn_prompts=self.turn_prompts,
            info=self.info,
            prompt_tokens=self.prompt_tokens,
            error_kind=self.error_kind,
            tool_calls=self.tool_stats.calls,
            tool_errors=self.tool_stats.errors,
            tool_seconds=self.tool_stats.seconds,
            tool_truncated=self.tool_stats.truncated,
            turn_calls=self.tool_stats.per_turn,
        )

    # ---- one turn --------------------------------------------------------------------------
    def record(
        self, out: GenOutput, tokenizer: Any, parser: ToolParser | None, limits: TurnLimits
    ) -> ParsedTurn | str | None:
        """Append the generated turn; return its tool calls (a :class:`ParsedTurn` that called), the
        assistant's text for the environment's ``step``, or None when the episode ends here (a row
        played without an environment is one turn: reward functions score it). The text is read
        by :func:`read_calls`: whatever the parser makes of it, the episode goes on."""
        content, closing = assistant_text(self.messages, out, self.chat, tokenizer, self.raw)
        if self.turn_prompts is not None:
            self.turn_prompts.append(self.prompt())
        self.turn_starts.append(len(self.token_ids))
        self.append(list(out.token_ids), 1, [float(x) for x in out.logprobs])
        self.append(self.chat.encode(closing), 0)
        self.messages.append({"role": "assistant", "content": content})
        parsed = (
            read_calls(parser, content, limits.max_argument_chars)
            if parser is not None and self.tools is not None and not self.raw
            else None
        )
        self.tool_stats.per_turn.append(list(parsed.calls) if parsed is not None else [])
        if parsed is not None and parsed.has_calls:
            return parsed
        if self.spec.env is None:
            self.turn_rewards.append(0.0)
            # a completion cut at max_new_tokens is a truncated episode (TRL's "truncated completion")
            self.done, self.truncated = True, out.finish_reason == "length"
            return None
        return content

    def apply_tools(
        self, parsed: ParsedTurn, results: list[ToolResult], limits: TurnLimits
    ) -> None:
        """The turn's tool results (and an error message for each call that could not be read) as
        ``tool`` messages, each cut to ``limits.max_result_chars`` before anything is tokenized (the
        model reads how much was cut); the episode goes on."""
        unread = [ToolResult("unparsed", f"Error: {why}", True, 0.0) for why in parsed.errors]
        answers = [cut_result(r, limits.max_result_chars) for r in [*results, *unread]]
        self.tool_stats.add(answers)
        self.turn_rewards.append(0.0)
        self._continue([r.as_message() for r in answers], limits)

    def apply_step(self, result: StepResult | EnvFault, limits: TurnLimits) -> None:
        """The environment's answer to the turn: reward, outcome, and the next observation."""
        if isinstance(result, EnvFault):
            self.fail(result)
            return
        self.reward += result.reward
        self.turn_rewards.append(result.reward)
        self.invalid_action |= bool(result.info.get("invalid_action", False))
        self.outcome = result.info.get("outcome", self.outcome)
        self.info = dict(result.info)
        if result.done:
            self.done = True
            return
        self._continue([{"role": "user", "content": result.observation}], limits)

    def _continue(self, new: Messages, limits: TurnLimits) -> None:
        """Append ``new`` messages and the next generation prompt, or end the episode (truncated)
        when the turns are used up or the next turn would not fit."""
        if self.num_turns >= limits.max_turns:
            self.truncated = True
            return
        try:
            delta = self.chat.encode(self.chat.next_messages(self.messages, new))
        # the template rewrote an earlier turn: every turn is its own row from now on
        except NotAppendOnly:
            self.rewrites = True
            if self.turn_prompts is None:
                self.turn_prompts = [self.token_ids[:s] for s in self.turn_starts]
            delta = self.chat.encode(self.chat.rewritten_tail(self.messages, new))
        if limits.history_turns is not None:
            self.next_prompt = self.chat.encode(
                self.chat.prompt(window([*self.messages, *new], limits.history_turns))
            )
        elif self.rewrites:
            self.next_prompt = self.chat.encode(self.chat.prompt([*self.messages, *new]))
        need = (
            len(self.next_prompt)
            if self.next_prompt is not None
            else len(self.token_ids) + len(delta)
        )
        if need > limits.budget:
            self.truncated = True
            return
        self.messages.extend(new)
        self.append(delta, 0)


def cut_result(result: ToolResult, max_chars: int | None) -> ToolResult:
    """``result`` with its text cut to ``max_chars`` characters and the cut said at its end
    (``[... truncated N characters]``), marked ``truncated``; as it is when it fits."""
    if max_chars is None or len(result.content) <= max_chars:
        return result
    cut = len(result.content) - max_chars
    text = f"{result.content[:max_chars]}\n[... truncated {cut} characters]"
    return replace(result, content=text, truncated=True)


def window(messages: Messages, history_turns: int) -> Messages:
    """[system] + the last ``history_turns`` exchanges + the messages after the last assistant turn
    (the observation, or a turn's tool results)."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head) :]
    last = max((i for i, m in enumerate(body) if m["role"] == "assistant"), default=-1)
    tail, earlier = body[last + 1 :], body[: last + 1]
    return head + earlier[max(len(earlier) - 2 * history_turns, 0) :] + tail


def assistant_text(
    messages: Messages, out: GenOutput, chat: ChatDeltas, tokenizer: Any, raw: bool = False
) -> tuple[str, str]:
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
            return content, end[len(eos_text) :]
    return content, end


def tool_items(
    states: list[LiveEpisode], parsed: list[ParsedTurn]
) -> list[tuple[ToolSet, list[ToolCall]]]:
    """What :meth:`EnvCalls.tools_all` runs for these episodes' turns."""
    return [(st.tools, p.calls) for st, p in zip(states, parsed)]

"""One episode's calls to the endpoint, recorded as the token rows the trainer learns from.

The agent sends whole conversations; the trainer needs the exact tokens the model sampled. Each
call is placed in the episode's current *row*:

- **It extends the row** when its messages are the previous call's messages, then the response
  the endpoint gave (recognized by its tool-call ids, or its text), then new messages (tool
  results, a user turn). Only the new messages are rendered and tokenized (the chat template's
  delta, :class:`~earl_lightning.rollout.chat.ChatDeltas`), after the sampled ids themselves: the
  row is one masked multi-turn sequence, mask 1 on sampled tokens only.
- **It starts a new row** of the same episode otherwise (the agent summarised, trimmed or
  rewrote its context): the whole prompt is rendered, with every earlier response of the episode
  put back as the text the model wrote (so the model reads its own format), and tokenized.

Training uses the sampled ids and their log-probs; no response text is ever tokenized again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from earl_lightning.rollout.backends.base import GenOutput, GenRequest
from earl_lightning.rollout.chat import ChatDeltas, NotAppendOnly
from earl_lightning.rollout.endpoint.protocol import ApiError, ChatRequest, Sampled, bad
from earl_lightning.rollout.turns import assistant_text
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.tasks.tool_parsers import ToolParser, read_calls

# backend request keys: a row has its own (its KV cache, its sampling stream); row 0's key is the
# episode id, as the native rollout's, so the same model samples the same tokens on both paths
ROW_KEY_STRIDE = 1 << 40


def row_key(episode_id: int, row: int) -> int:
    return episode_id + row * ROW_KEY_STRIDE


def episode_of(key: int) -> int:
    return key % ROW_KEY_STRIDE


# no tokenizer writes more characters per token on average: a request longer than this many
# characters per context token is refused before it is rendered or tokenized
MAX_CHARS_PER_TOKEN = 32
# where each built-in parser's calls begin: the text before is the response's content
_CALL_MARKS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


@dataclass
class CallLimits:
    """What bounds an episode's calls: how many (the recipe's ``max_turns``), the longest context
    a call may reach (``max_context_tokens``), the longest completion (``max_new_tokens``), and
    the longest arguments a tool call read from the model may have (None: no cap)."""

    max_calls: int
    max_context_tokens: int
    max_new_tokens: int
    max_argument_chars: int | None = None


@dataclass
class Row:
    """A row of the episode: one token sequence in chat form, grown call by call."""

    key: int
    tools_key: str
    chat: ChatDeltas
    messages: list[dict[str, Any]]  # as rendered: the endpoint's responses as the model's own text
    sent: list[dict[str, Any]]  # the last call's messages as the agent sent them
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    answer: dict[str, Any] | None = None  # the last response, as the agent will send it back

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.action_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class EpisodeCalls:
    """The recorded calls of one episode (see the module); called by one request at a time."""

    def __init__(
        self, spec: EpisodeSpec, tokenizer: Any, parser: ToolParser | None, limits: CallLimits
    ) -> None:
        self.spec, self.tokenizer, self.parser, self.limits = spec, tokenizer, parser, limits
        self.rows: list[Row] = []
        self.calls = 0
        self.tool_calls = 0
        self.refused = False  # a call was refused for the turn or context limit
        self.finished = False
        self._own: dict[str, str] = {}  # the model's text of each response, by call id and content
        self._chats: dict[str, ChatDeltas] = {}
        self._transcript: list[dict[str, Any]] = []

    # ---- a call -------------------------------------------------------------------------------
    def prepare(self, request: ChatRequest) -> tuple[GenRequest, int]:
        """The generation request of ``request`` (its row extended, or a new row), and the
        completion's token budget; raises :class:`ApiError` past the episode's limits."""
        if self.finished:
            raise ApiError(
                409, "this episode has ended; its key takes no more calls", code="episode_ended"
            )
        if self.calls >= self.limits.max_calls:
            self.refused = True
            raise bad(
                f"this episode reached its {self.limits.max_calls} model calls "
                "(`--model.rollout.max_turns`)",
                code="max_turns_exceeded",
            )
        self._check_size(request)
        row, new, ids = self._extended(request) or self._new_row(request)
        budget = min(request.max_tokens or self.limits.max_new_tokens, self.limits.max_new_tokens)
        need = len(row.token_ids) + len(ids) + budget
        if need > self.limits.max_context_tokens:
            self.refused = True
            raise bad(
                f"This model's maximum context length is {self.limits.max_context_tokens} tokens. "
                f"However, you requested {need} tokens ({need - budget} in the messages, "
                f"{budget} in the completion). Please reduce the length of the messages or "
                "completion.",
                "messages",
                "context_length_exceeded",
            )
        if not self.rows or row is not self.rows[-1]:
            self.rows.append(row)
        row.messages.extend(new)
        row.append(ids, 0)
        row.sent = list(request.messages)
        self._transcript = list(request.messages)
        self.calls += 1
        return GenRequest(row.key, list(row.token_ids), request.messages[-1]["content"]), budget

    def _check_size(self, request: ChatRequest) -> None:
        """A request far longer than any context is refused before its text is tokenized."""
        chars = sum(len(m["content"]) for m in request.messages) + len(
            json.dumps(request.tools or [])
        )
        limit = self.limits.max_context_tokens * MAX_CHARS_PER_TOKEN
        if chars > limit:
            self.refused = True
            raise bad(
                f"This model's maximum context length is {self.limits.max_context_tokens} tokens; "
                f"the messages hold {chars:,} characters, more than any tokenizer fits in it "
                f"({limit:,}). Please reduce the length of the messages.",
                "messages",
                "context_length_exceeded",
            )

    def _extended(self, request: ChatRequest) -> tuple[Row, list[dict], list[int]] | None:
        """The current row, the call's new messages and their tokens, when the call continues
        the row (see the module)."""
        row = self.rows[-1] if self.rows else None
        n = len(row.sent) if row is not None else 0
        msgs = request.messages
        if (
            row is None
            or row.answer is None
            or row.tools_key != _tools_key(request.tools)
            or len(msgs) <= n + 1
            or msgs[:n] != row.sent
            or not _same_answer(msgs[n], row.answer)
        ):
            return None
        new = [self._as_rendered(m) for m in msgs[n + 1 :]]
        try:
            delta = row.chat.next_messages(row.messages, new)
        except NotAppendOnly:
            return None  # the template rewrites earlier turns: the call is its own row
        return row, new, row.chat.encode(delta)

    def _new_row(self, request: ChatRequest) -> tuple[Row, list[dict], list[int]]:
        tools_key = _tools_key(request.tools)
        chat = self._chats.get(tools_key)
        if chat is None:
            chat = self._chats[tools_key] = ChatDeltas(self.tokenizer, request.tools)
        messages = [self._as_rendered(m) for m in request.messages]
        row = Row(row_key(self.spec.episode_id, len(self.rows)), tools_key, chat, [], [])
        return row, messages, chat.encode(chat.prompt(messages))

    def _as_rendered(self, m: dict[str, Any]) -> dict[str, Any]:
        """A message as the template renders it: one of the endpoint's own responses becomes the
        text the model wrote; any other message stays as sent."""
        if m["role"] != "assistant":
            return m
        ids = tuple(c.get("id") for c in m.get("tool_calls") or ())
        text = self._own.get(json.dumps(ids)) if ids else self._own.get("text:" + m["content"])
        return {"role": "assistant", "content": text} if text is not None else m

    # ---- its result -----------------------------------------------------------------------------
    def record(
        self, out: GenOutput, tool_choice: str, call_id: str, token_texts: bool = False
    ) -> Sampled:
        """Append the sampled ids (mask 1, their log-probs) and the turn's closing text (mask 0)
        to the current row; the response's content and tool calls (read by the recipe's parser),
        and each token's text when ``token_texts`` (a call that asked for log-probs)."""
        row = self.rows[-1]
        text, closing = assistant_text(row.messages, out, row.chat, self.tokenizer)
        prompt = list(row.token_ids)
        row.turn_starts.append(len(row.token_ids))
        row.append(list(out.token_ids), 1, [float(x) for x in out.logprobs])
        row.append(row.chat.encode(closing), 0)
        row.messages.append({"role": "assistant", "content": text})
        content, calls = self._read_calls(text, tool_choice, call_id)
        row.answer = {"role": "assistant", "content": content or "", "tool_calls": calls}
        key = json.dumps(tuple(c["id"] for c in calls)) if calls else "text:" + (content or "")
        self._own[key] = text
        self.tool_calls += len(calls)
        self._transcript = [*self._transcript, _as_message(content, calls)]
        tokens = [self.tokenizer.decode([t]) for t in out.token_ids] if token_texts else []
        return Sampled(
            prompt,
            list(out.token_ids),
            list(out.logprobs),
            out.finish_reason,
            content,
            calls,
            tokens,
        )

    def _read_calls(
        self, text: str, tool_choice: str, call_id: str
    ) -> tuple[str | None, list[dict[str, Any]]]:
        tools = self.rows[-1].chat.tools
        if self.parser is None or not tools or tool_choice == "none":
            return text, []
        # never raises; a call the model wrote badly stays in the text, unread
        parsed = read_calls(self.parser, text, self.limits.max_argument_chars)
        if not parsed.calls:
            return text, []
        calls = [
            {
                "id": f"call_{call_id}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for k, c in enumerate(parsed.calls)
        ]
        at = min((text.find(m) for m in _CALL_MARKS if m in text), default=-1)
        content = text[:at].strip() if at >= 0 else ""
        return content or None, calls

    def to_episode(
        self, reward: float | None, info: dict[str, Any], error: str | None, truncated: bool
    ) -> Episode:
        """The episode: its rows' tokens one after another (``row_starts`` marks each row after
        the first), the whole transcript as the agent last saw it, and its reward; ``truncated``:
        it ended on a call refused at a limit."""
        ids, mask, lps, starts, row_starts = [], [], [], [], []
        for k, row in enumerate(self.rows):
            if k:
                row_starts.append(len(ids))
            starts += [len(ids) + s for s in row.turn_starts]
            ids, mask, lps = ids + row.token_ids, mask + row.action_mask, lps + row.logprobs
        return Episode(
            spec=self.spec,
            token_ids=ids,
            action_mask=mask,
            logprobs=lps,
            reward=0.0 if error is not None or reward is None else reward,
            num_turns=len(starts),
            done=error is None and not truncated,
            truncated=truncated,
            invalid_action=bool(info.get("invalid_action", False)),
            outcome=info.get("outcome") if isinstance(info.get("outcome"), str) else None,
            error=error,
            turn_starts=starts,
            messages=[_plain(m) for m in self._transcript],
            info=info,
            prompt_tokens=self.rows[0].turn_starts[0]
            if self.rows and self.rows[0].turn_starts
            else 0,
            error_kind="env" if error is not None else None,
            tool_calls=self.tool_calls,
            row_starts=row_starts or None,
            from_agent=True,
            agent_reward=reward if error is None else None,
        )


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def _same_answer(sent: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Whether the agent's message ``sent`` is the endpoint's response ``answer``: the same calls
    (by id, name and arguments) and the same text (an agent may drop the text beside calls)."""
    if sent["role"] != "assistant":
        return False
    ours = [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in answer["tool_calls"]
    ]
    theirs = [
        (c.get("id"), c["function"]["name"], c["function"]["arguments"])
        for c in sent.get("tool_calls") or ()
    ]
    if ours != theirs:
        return False
    text = sent.get("content") or ""
    return text.strip() == (answer["content"] or "").strip() or (bool(ours) and not text)


def _as_message(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        out["tool_calls"] = [
            {
                **c,
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.loads(c["function"]["arguments"]),
                },
            }
            for c in calls
        ]
    return out


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    return dict(m)

"""The OpenAI chat-completions wire format the endpoint speaks: a request read into a
:class:`ChatRequest` (or an :class:`ApiError`, OpenAI's JSON error body with a 4xx status), and a
response built from what was sampled.

Only what the endpoint supports is accepted, each field checked where it is read: ``messages``,
``tools``, ``tool_choice`` (``auto`` / ``none``), ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``logprobs`` / ``top_logprobs`` (0 only) and ``n`` (1 only);
any other field an SDK sends by default (``stream: false``, ``user``, ``metadata``, ...) is
ignored when it asks for nothing the endpoint would have to do. Pure Python: no server, no model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields that ask for something the endpoint does not do, and the value that asks for nothing
_MUST_BE = {
    "n": (1, None),
    "stream": (False, None),
    "top_logprobs": (0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True, False),
}
MAX_BODY_BYTES = 32 << 20  # a request body past this is refused (413) before it is parsed


class ApiError(Exception):
    """An error the endpoint answers with: an HTTP status and OpenAI's error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class ChatRequest:
    """A checked chat-completions request. ``messages`` are in the chat template's form: text
    content, and an assistant message's ``tool_calls`` with their arguments as objects."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False


def parse_request(body: Any) -> ChatRequest:
    """``body`` (the decoded JSON) as a :class:`ChatRequest`, or an :class:`ApiError` naming the
    field, the value and what is allowed."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(f"'model' must be a non-empty string, got {_short(model)}", "model")
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice", "auto")),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        logprobs=_flag(body, "logprobs"),
    )


def _check_unsupported(body: dict[str, Any]) -> None:
    for name, allowed in _MUST_BE.items():
        if name in body and body[name] not in allowed:
            shown = ", ".join("null" if a is None else json.dumps(a) for a in allowed)
            raise bad(
                f"'{name}' {_short(body[name])} is not supported by this endpoint (allowed: {shown})",
                name,
                "unsupported_parameter",
            )


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad(
            f"'messages' must be a non-empty list of messages, got {_short(value)}", "messages"
        )
    return [_message(m, i) for i, m in enumerate(value)]


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"'{where}' must be an object, got {_short(m)}", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"'{where}.role' {_short(role)} is not one of {list(ROLES)}", f"{where}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _content(m.get("content"), f"{where}.content", role)
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [
            _call(c, f"{where}.tool_calls[{k}]")
            for k, c in enumerate(_list(m["tool_calls"], f"{where}.tool_calls"))
        ]
    if role == "tool":
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _content(value: Any, where: str, role: str) -> str:
    """Text content: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if value is None and role == "assistant":
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            if not (
                isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text")
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(
                    f"'{where}[{k}]' is a {_short(kind)} part; this endpoint takes text only", where
                )
            if not isinstance(part.get("text"), str):
                raise bad(f"'{where}[{k}].text' must be a string", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"'{where}' must be a string or a list of text parts, got {_short(value)}", where)


def _call(c: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call, its arguments decoded into an object (what chat templates
    render); the call's id is kept (the endpoint recognizes its own calls by it)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(
            f"'{where}' must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise bad(
                f"'{where}.function.arguments' is not valid JSON: {args[:80]!r}", where
            ) from None
    return {
        "id": str(c.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    tools = _list(value, "tools")
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
        ):
            raise bad(
                f"'tools[{k}]' must be {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}",
                f"tools[{k}]",
            )
    return [{"type": "function", "function": t["function"]} for t in tools] or None


def _tool_choice(value: Any) -> str:
    if value in ("auto", "none"):
        return value
    raise bad(
        f"'tool_choice' {_short(value)} is not supported: 'auto' (the model decides) or 'none' (calls "
        "are not read); the endpoint samples the model as trained and cannot force a call",
        "tool_choice",
        "unsupported_parameter",
    )


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise bad(f"'{name}' must be a number in [{low:g}, {high:g}], got {_short(value)}", name)
    return float(value)


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"'{name}' must be an integer >= 1, got {_short(value)}", name)
        return value
    return None


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else ([] if value is None else value)
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > 4
    ):
        raise bad(
            f"'stop' must be a non-empty string or a list of at most 4 of them, got {_short(value)}",
            "stop",
        )
    return stops


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {_short(value)}", name)
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad(f"'{where}' must be a list, got {_short(value)}", where)
    return value


def _short(value: Any) -> str:
    text = (
        json.dumps(value)
        if isinstance(value, (str, int, float, bool, type(None)))
        else type(value).__name__
    )
    return text if len(text) <= 60 else text[:57] + "..."


# ---- responses ----------------------------------------------------------------------------------


@dataclass
class Sampled:
    """What one call sampled, for its response: the ids and log-probs, the text, the calls read
    from it (as OpenAI ``tool_calls``), the content outside them, and why it stopped."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    tokens: list[str]  # each sampled token's text (filled when log-probs were asked)


def completion(
    call_id: str, model: str, created: int, s: Sampled, logprobs: bool
) -> dict[str, Any]:
    """The chat-completion object, with vLLM's extra fields: ``prompt_token_ids`` (top level) and
    ``token_ids`` (in the choice), and the sampled log-probs when ``logprobs`` was asked."""
    message: dict[str, Any] = {"role": "assistant", "content": s.content}
    if s.tool_calls:
        message["tool_calls"] = s.tool_calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if s.tool_calls else s.finish_reason,
        "logprobs": None,
        "token_ids": s.token_ids,
    }
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(s.tokens, s.logprobs)
            ]
        }
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(s.token_ids),
            "total_tokens": len(s.prompt_ids) + len(s.token_ids),
        },
        "prompt_token_ids": s.prompt_ids,
    }

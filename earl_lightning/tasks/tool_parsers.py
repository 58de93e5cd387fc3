"""Reading tool calls from a model's turn, in the model's own format; a registry by name.

A parser takes the assistant's generated text and returns a :class:`ParsedTurn`: the calls it
found and the problems it met (a call that is not valid JSON, lacks a name, or has arguments that
are not an object). The problems go back to the model as ``tool`` messages; nothing raises.

Built in:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  several in one turn, text around them allowed.
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the turn is a JSON object ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A user's parser is a function ``text -> ParsedTurn`` registered with ``@register_tool_parser(name)``
or named by import path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from earl_lightning.registry import Registry
from earl_lightning.tasks.tools import ToolCall


@dataclass
class ParsedTurn:
    """The calls of one assistant turn, and what could not be read as a call (one line each)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the turn tried to call a tool (a malformed call counts: it gets an answer)."""
        return bool(self.calls or self.errors)


ToolParser = Callable[[str], ParsedTurn]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parsers")


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    return TOOL_PARSERS.register(name)


def get_tool_parser(name: str, arg: str = "--model.rollout.tool_parser") -> ToolParser:
    return TOOL_PARSERS.get(name, arg)


def _call_from(obj: Any, args_key: str) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name, arguments = obj.get("name"), obj.get(args_key, {})
    if not isinstance(name, str) or not name:
        return f'a tool call needs a "name" string, got {json.dumps(obj)[:80]}'
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are a string that is not JSON: {arguments[:60]!r}"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments)


def _add(turn: ParsedTurn, text: str, args_key: str) -> None:
    try:
        found = _call_from(json.loads(text), args_key)
    except json.JSONDecodeError as err:
        found = f"a tool call is not valid JSON ({err.msg} at character {err.pos}): {text[:80]!r}"
    if isinstance(found, ToolCall):
        turn.calls.append(found)
    else:
        turn.errors.append(found)


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@register_tool_parser("hermes")
def hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks; one left open at the end of the turn is an error."""
    turn = ParsedTurn()
    for body, close in _HERMES.findall(text):
        if not close:
            turn.errors.append(
                f"a <tool_call> is not closed with </tool_call>: {body.strip()[:80]!r}"
            )
        else:
            _add(turn, body.strip(), "arguments")
    return turn


@register_tool_parser("llama3_json")
def llama3_json(text: str) -> ParsedTurn:
    """The whole turn as ``{"name": ..., "parameters": {...}}`` (``;``-separated for several);
    a turn that does not start with ``{`` is a plain message."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    turn = ParsedTurn()
    if not body.startswith("{"):
        return turn
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as err:
            turn.errors.append(
                f"a tool call is not valid JSON ({err.msg} at character {err.pos}): "
                f"{body[pos : pos + 80]!r}"
            )
            return turn
        found = _call_from(
            obj, "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
        )
        (turn.calls if isinstance(found, ToolCall) else turn.errors).append(found)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return turn


_MISTRAL = "[TOOL_CALLS]"


@register_tool_parser("mistral")
def mistral(text: str) -> ParsedTurn:
    """``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects."""
    turn = ParsedTurn()
    at = text.find(_MISTRAL)
    if at < 0:
        return turn
    body = text[at + len(_MISTRAL) :].strip()
    try:
        calls = json.JSONDecoder().raw_decode(body)[0]
    except json.JSONDecodeError as err:
        turn.errors.append(
            f"the [TOOL_CALLS] list is not valid JSON ({err.msg} at character {err.pos}): "
            f"{body[:80]!r}"
        )
        return turn
    for obj in calls if isinstance(calls, list) else [calls]:
        found = _call_from(obj, "arguments")
        (turn.calls if isinstance(found, ToolCall) else turn.errors).append(found)
    return turn

"""Reading tool calls from a model's turn, in the model's own format; a registry by name.

A parser takes the assistant's generated text and returns a :class:`ParsedTurn`: the calls it
found and the problems it met (a call that is not valid JSON, lacks a name, or has arguments that
are not an object). The problems go back to the model as ``tool`` messages; nothing raises.

The text is the model's own output, so anything may be in it: JSON nested a thousand levels deep
(``RecursionError`` in ``json``), a number of five thousand digits (``ValueError``: Python's
int-string conversion limit). :func:`read_calls` is how the rollout runs any parser, built in or
the user's: whatever the parser raises or returns that is not a :class:`ParsedTurn` becomes one
error, and a call whose arguments nest deeper than :data:`MAX_ARGUMENT_DEPTH` levels or are longer
than the cap (``--model.rollout.max_tool_argument_chars``) is an error instead of a call.

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

from earl_lightning.core.registry import Registry
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
# Arguments nested deeper than this are refused: every later step that walks them (the schema
# check, a transcript, pickling for a worker process) recurses, and Python's stack is ~1,000 deep.
MAX_ARGUMENT_DEPTH = 32


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    """Decorator registering a parser ``text -> ParsedTurn`` as ``name``.

    Args:
        name: the name a config selects it by (``--model.rollout.tool_parser name``).

    Returns:
        The decorator; it returns the parser unchanged.

    Raises:
        ValueError: when the decorator is applied and ``name`` is already registered (two modules
            cannot silently shadow each other's parser).
    """
    return TOOL_PARSERS.register(name)


def get_tool_parser(name: str, arg: str = "--model.rollout.tool_parser") -> ToolParser:
    """The parser registered as ``name`` (or at that import path); an unknown name is a
    ValueError naming ``arg`` and listing the registered parsers."""
    return TOOL_PARSERS.get(name, arg)


def _unreadable(err: Exception, text: str, what: str = "a tool call") -> str:
    """Why ``text`` is not a call, for the model: the JSON error's place, or what Python refused
    (a RecursionError for deep nesting, a ValueError for a number of too many digits)."""
    if isinstance(err, json.JSONDecodeError):
        return f"{what} is not valid JSON ({err.msg} at character {err.pos}): {text[:80]!r}"
    return f"{what} cannot be read as JSON ({_said(err)}): {text[:80]!r}"


def _preview(obj: Any) -> str:
    """The first 80 characters of ``obj`` as JSON (its type, where even that fails)."""
    try:
        return json.dumps(obj)[:80]
    except Exception:  # noqa: BLE001 - nested past the stack, or a number past the digit limit
        return f"a {type(obj).__name__} that cannot be shown"


def _call_from(obj: Any, args_key: str) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name, arguments = obj.get("name"), obj.get(args_key, {})
    if not isinstance(name, str) or not name:
        return f'a tool call needs a "name" string, got {_preview(obj)}'
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except Exception:  # noqa: BLE001 - the model's text: any failure is its error
            return f"the arguments of {name!r} are a string that is not JSON: {arguments[:60]!r}"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments)


def _add(turn: ParsedTurn, text: str, args_key: str) -> None:
    try:
        found = _call_from(json.loads(text), args_key)
    except Exception as err:  # noqa: BLE001 - the model's text: any failure is its error
        found = _unreadable(err, text)
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
        except Exception as err:  # noqa: BLE001 - the model's text: any failure is its error
            turn.errors.append(_unreadable(err, body[pos:]))
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
    except Exception as err:  # noqa: BLE001 - the model's text: any failure is its error
        turn.errors.append(_unreadable(err, body, "the [TOOL_CALLS] list"))
        return turn
    for obj in calls if isinstance(calls, list) else [calls]:
        found = _call_from(obj, "arguments")
        (turn.calls if isinstance(found, ToolCall) else turn.errors).append(found)
    return turn


def read_calls(parser: ToolParser, text: str, max_argument_chars: int | None = None) -> ParsedTurn:
    """The calls ``parser`` reads in ``text``, never raising: what the parser raises, or returns
    that is not a :class:`ParsedTurn`, is one error; so is each call whose arguments are not plain
    JSON data (nested at most :data:`MAX_ARGUMENT_DEPTH` levels, at most ``max_argument_chars``
    characters written as JSON; None: no length cap)."""
    try:
        turn = parser(text)
    except Exception as err:  # noqa: BLE001 - any parser, on any text: the model reads what went wrong
        return ParsedTurn(errors=[f"the tool-call parser {_name(parser)!r} {_raised(err)}"])
    if not isinstance(turn, ParsedTurn):
        return ParsedTurn(
            errors=[
                f"the tool-call parser {_name(parser)!r} returned {type(turn).__name__}, not a "
                f"ParsedTurn"
            ]
        )
    out = ParsedTurn(errors=[e if isinstance(e, str) else _shown(e) for e in turn.errors])
    for call in turn.calls:
        problem = _argument_problem(call, max_argument_chars)
        (out.errors if problem is not None else out.calls).append(problem or call)
    return out


def _argument_problem(call: Any, max_chars: int | None) -> str | None:
    """Why ``call`` is not run (None when it is fine)."""
    if not isinstance(call, ToolCall) or not isinstance(call.name, str):
        return f"the tool-call parser returned {_shown(call)} as a call, not a ToolCall"
    if not isinstance(call.arguments, dict):
        return f"the arguments of {call.name!r} must be a JSON object, got {type(call.arguments).__name__}"
    if _deeper_than(call.arguments, MAX_ARGUMENT_DEPTH):
        return f"the arguments of {call.name!r} nest deeper than {MAX_ARGUMENT_DEPTH} levels"
    try:
        size = len(json.dumps(call.arguments))
    except Exception as err:  # noqa: BLE001 - a number past the digit limit, a non-JSON value
        return f"the arguments of {call.name!r} are not plain JSON data ({_raised(err)})"
    if max_chars is not None and size > max_chars:
        return (
            f"the arguments of {call.name!r} are {size} characters of JSON; at most {max_chars} are "
            f"read (`--model.rollout.max_tool_argument_chars`)"
        )
    return None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels in ``value`` (walked without recursion;
    a structure that contains itself counts as too deep)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth > limit:
                return True
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
            )
    return False


def _shown(obj: Any) -> str:
    """``type repr`` of something a user's parser returned, at most 60 characters of the repr."""
    try:
        return f"{type(obj).__name__} {repr(obj)[:60]}"
    except Exception:  # noqa: BLE001 - nested past the stack, a number past the digit limit
        return type(obj).__name__


def _name(fn: Any) -> str:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else type(fn).__name__


def _raised(err: Exception) -> str:
    return f"raised {_said(err)}"


def _said(err: Exception) -> str:
    """``Type: the first line of the message`` (the type alone when there is none)."""
    try:
        lines = str(err).splitlines()
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        lines = []
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__

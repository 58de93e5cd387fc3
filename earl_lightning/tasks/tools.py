"""Tools as users define them: Python functions with type hints and a docstring (their JSON schema
from transformers' ``get_json_schema``, what ``apply_chat_template(..., tools=...)`` renders), or
a JSON-schema dict with the function that serves it.

:class:`ToolSet` runs the calls a parser read from the model's turn: an unknown tool, arguments
that do not fit the schema, an exception or a time-out become the text of the ``tool`` message the
model sees next (``Error: ...``), counted as an error, never an exception out of the rollout. Pure
Python: no torch, no trainer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from earl_lightning.core.registry import import_object

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def as_message(self) -> dict[str, Any]:
        """TRL's / OpenAI's form of the call inside an assistant message's ``tool_calls``."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolResult:
    """What a call returned (the ``tool`` message's content), whether it failed, its seconds, and
    whether the content was cut to the result budget (``rollout.max_tool_result_chars``)."""

    name: str
    content: str
    error: bool
    seconds: float
    truncated: bool = False

    def as_message(self) -> dict[str, Any]:
        """The ``tool`` message that answers the call in the conversation (TRL's / OpenAI's form)."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its schema (OpenAI's ``{"type": "function", "function":
    {...}}``) and the callable that serves it (plain or ``async def``)."""

    schema: dict[str, Any]
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        """The name the model calls the tool by (the schema's ``function.name``)."""
        return self.schema["function"]["name"]

    def check_arguments(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit the schema (None when they do): a JSON object, every required
        parameter present, no unknown one, each of its declared JSON type."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        params = self.schema["function"].get("parameters") or {}
        props = params.get("properties") or {}
        missing = [p for p in params.get("required", []) if p not in arguments]
        if missing:
            return f"missing required argument(s) {missing}"
        unknown = sorted(set(arguments) - set(props))
        if unknown and props:
            return f"unknown argument(s) {unknown}; it takes {sorted(props)}"
        for name, value in arguments.items():
            kind = (props.get(name) or {}).get("type")
            kinds = kind if isinstance(kind, list) else [kind] if kind else []
            ok = not kinds or any(
                isinstance(value, _JSON_TYPES.get(k, object))
                and not (k in ("integer", "number") and isinstance(value, bool))
                for k in kinds
            )
            if not ok:
                return f"argument {name!r} must be of type {kind}, got {type(value).__name__} {value!r:.40}"
        return None


def tool_of(obj: Any, arg: str) -> Tool:
    """A :class:`Tool` from a callable (schema from its signature and docstring), an import path of
    one, or a ``{"schema": {...}, "fn": callable}`` / ``(schema, fn)`` pair; errors name ``arg``."""
    from transformers.utils import get_json_schema

    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, str):
        obj = import_object(obj, arg)
    if isinstance(obj, tuple) and len(obj) == 2:
        obj = {"schema": obj[0], "fn": obj[1]}
    if isinstance(obj, Mapping):
        schema, fn = obj.get("schema"), obj.get("fn")
        if not isinstance(schema, Mapping) or "function" not in schema or not callable(fn):
            raise ValueError(
                f"`{arg}`: a tool given as a dict needs `schema` (OpenAI's {{'type': 'function', "
                f"'function': {{'name': ..., 'parameters': ...}}}}) and `fn` (the callable), got "
                f"{sorted(obj)}"
            )
        return Tool(dict(schema), fn)
    if not callable(obj):
        raise ValueError(
            f"`{arg}` is {type(obj).__name__} {obj!r:.60}, not a tool: give a function with type hints "
            f"and a docstring, or {{schema, fn}}"
        )
    try:
        schema = get_json_schema(obj)
    except Exception as err:  # noqa: BLE001 - transformers' DocstringParsingException and TypeError alike
        raise ValueError(
            f"`{arg}` {getattr(obj, '__name__', obj)!r}: no JSON schema can be read from it "
            f"({type(err).__name__}: {str(err).splitlines()[0][:160]}); give every argument a type hint "
            f"and an `Args:` line in the docstring"
        ) from None
    return Tool(schema, obj)


SCHEMA_FORMS = ("full", "compact")


def shown_schema(schema: dict[str, Any], form: str = "full") -> dict[str, Any]:
    """``schema`` as the prompt renders it: ``full`` as it is; ``compact`` without what the model
    needs least (each parameter's description and the return value's entry), keeping the tool's
    name, its description and its parameters' names, types and which are required. A template
    that renders the whole schema (Qwen2.5's, ``earl-tiny-bpe``'s) then costs fewer tokens."""
    if form == "full":
        return schema
    function = {k: v for k, v in schema["function"].items() if k != "return"}
    params = function.get("parameters")
    if isinstance(params, dict) and isinstance(params.get("properties"), dict):
        function["parameters"] = {
            **params,
            "properties": {
                name: {k: v for k, v in prop.items() if k != "description"}
                if isinstance(prop, dict)
                else prop
                for name, prop in params["properties"].items()
            },
        }
    return {**schema, "function": function}


def resolve_tools(tools: Sequence[Any] | None, arg: str = "--data.tools") -> list[Tool]:
    """The tools of a config, each checked (:func:`tool_of`); two of one name is an error."""
    out = [tool_of(t, f"{arg}[{i}]") for i, t in enumerate(tools or [])]
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"`{arg}` names two tools {dup[0]!r}; tool names must be distinct")
    return out


class ToolSet:
    """The tools of an episode by name; :meth:`call` runs one call and never raises.

    ``timeout_s``: a call still running after that long fails (its thread is left to finish; an
    ``async def`` tool is cancelled)."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float | None = None) -> None:
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            names = [t.name for t in tools]
            raise ValueError(
                f"two tools share a name: {sorted({n for n in names if names.count(n) > 1})}"
            )
        self.timeout_s = timeout_s

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, in the order given: what the chat template renders into a prompt."""
        return [t.schema for t in self.tools.values()]

    def owner(self, call: ToolCall) -> Callable[..., Any] | None:
        """The function a call runs (None for an unknown tool)."""
        tool = self.tools.get(call.name)
        return tool.fn if tool is not None else None

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call: an unknown tool, arguments that do not fit the schema, a tool that raises,
        times out or returns what cannot be written as text each give an error result (the
        model reads it as the ``tool`` message) instead of an exception."""
        start = time.perf_counter()
        tool = self.tools.get(call.name)
        if tool is None:
            return self._result(
                call,
                f"Error: unknown tool {call.name!r}; the tools are {sorted(self.tools)}",
                start,
            )
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            return self._result(call, f"Error: bad arguments for {call.name!r}: {problem}", start)
        try:
            value = _run(tool.fn, call.arguments, self.timeout_s)
        except TimeoutError:
            return self._result(
                call, f"Error: {call.name!r} did not return within {self.timeout_s:g} s", start
            )
        except Exception as err:  # noqa: BLE001 - the user's tool: its failure is the model's observation
            return self._result(
                call, f"Error: {call.name!r} raised {type(err).__name__}: {str(err)[:300]}", start
            )
        try:
            text = _as_text(value)
        except Exception as err:  # noqa: BLE001 - nested past the stack, a number past the digit limit
            return self._result(
                call,
                f"Error: {call.name!r} returned a value of type {type(value).__name__} that cannot be "
                f"written as text ({type(err).__name__})",
                start,
            )
        return ToolResult(call.name, text, False, time.perf_counter() - start)

    @staticmethod
    def _result(call: ToolCall, text: str, start: float) -> ToolResult:
        return ToolResult(call.name, text, True, time.perf_counter() - start)


def _run(fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float | None) -> Any:
    if inspect.iscoroutinefunction(fn):
        from earl_lightning.tasks.rewards import event_loop

        future = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(fn(**arguments), timeout_s), event_loop()
        )
        return future.result()
    if timeout_s is None:
        return fn(**arguments)
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="earl-tool")
    try:
        return pool.submit(fn, **arguments).result(timeout=timeout_s)
    except FutureTimeout:
        raise TimeoutError from None
    finally:
        pool.shutdown(wait=False)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


@dataclass
class ToolStats:
    """An episode's tool use: calls made, calls that failed, seconds spent in them, results cut to
    the result budget."""

    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    truncated: int = 0
    per_turn: list[list[ToolCall]] = field(default_factory=list)  # the calls each turn made

    def add(self, results: Sequence[ToolResult]) -> None:
        """Count the results of one turn's calls (the caller records the calls themselves in
        ``per_turn``)."""
        self.calls += len(results)
        self.errors += sum(r.error for r in results)
        self.seconds += sum(r.seconds for r in results)
        self.truncated += sum(r.truncated for r in results)

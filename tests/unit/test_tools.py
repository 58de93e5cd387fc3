"""Tools as users write them (a typed, documented function; a {schema, fn} dict), the calls a
parser reads in each model format, and what a call that goes wrong tells the model."""

from __future__ import annotations

import asyncio

import pytest

from earl_lightning.tasks.tool_parsers import (
    TOOL_PARSERS,
    get_tool_parser,
    hermes,
    llama3_json,
    mistral,
)
from earl_lightning.tasks.tools import ToolCall, ToolSet, resolve_tools, tool_of


def lookup(city: str, year: int = 2020) -> dict:
    """Population of a city.

    Args:
        city: the city's name.
        year: the census year.
    """
    if city == "Atlantis":
        raise KeyError(city)
    return {"city": city, "year": year, "population": 1000 + year}


async def slow_echo(text: str) -> str:
    """Echo, after a pause.

    Args:
        text: what to echo.
    """
    await asyncio.sleep(0.01)
    return text.upper()


def no_doc(x: int) -> int:
    return x


SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a+b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def test_schemas_from_functions_and_dicts():
    tool = tool_of(lookup, "--data.tools[0]")
    params = tool.schema["function"]["parameters"]
    assert tool.name == "lookup" and params["required"] == ["city"]
    assert params["properties"]["year"]["type"] == "integer"
    add = tool_of({"schema": SCHEMA, "fn": lambda a, b: a + b}, "x")
    assert add.name == "add" and tool_of((SCHEMA, lambda a, b: a + b), "x").name == "add"
    assert [t.name for t in resolve_tools(["tests.unit.test_tools.lookup", slow_echo])] == [
        "lookup",
        "slow_echo",
    ]


def test_calls_and_what_the_model_reads_when_they_go_wrong():
    tools = ToolSet(
        resolve_tools([lookup, slow_echo, {"schema": SCHEMA, "fn": lambda a, b: a + b}])
    )
    ok = tools.call(ToolCall("lookup", {"city": "Oslo"}))
    assert not ok.error and ok.content == '{"city": "Oslo", "year": 2020, "population": 3020}'
    assert tools.call(ToolCall("slow_echo", {"text": "hi"})).content == "HI"
    assert tools.call(ToolCall("add", {"a": 2, "b": 3})).content == "5"
    cases = [
        (
            ToolCall("weather", {}),
            "Error: unknown tool 'weather'; the tools are ['add', 'lookup', 'slow_echo']",
        ),
        (
            ToolCall("lookup", {}),
            "Error: bad arguments for 'lookup': missing required argument(s) ['city']",
        ),
        (
            ToolCall("lookup", {"city": "Oslo", "zip": 1}),
            "Error: bad arguments for 'lookup': unknown argument(s) "
            "['zip']; it takes ['city', 'year']",
        ),
        (
            ToolCall("lookup", {"city": 3}),
            "Error: bad arguments for 'lookup': argument 'city' must be of type string, got int 3",
        ),
        (
            ToolCall("add", {"a": True, "b": 1}),
            "Error: bad arguments for 'add': argument 'a' must be of type integer, got bool True",
        ),
        (ToolCall("lookup", {"city": "Atlantis"}), "Error: 'lookup' raised KeyError: 'Atlantis'"),
    ]
    for call, text in cases:
        result = tools.call(call)
        assert result.error and result.content == text
        assert result.as_message() == {"role": "tool", "name": call.name, "content": text}


@pytest.mark.parametrize(
    "tool, message",
    [
        (no_doc, r"`--data.tools\[0\]` 'no_doc': no JSON schema can be read from it"),
        (3, r"`--data.tools\[0\]` is int 3, not a tool"),
        ({"fn": print}, r"`--data.tools\[0\]`: a tool given as a dict needs `schema`"),
        ("tests.unit.test_tools.nope", r"`--data.tools\[0\]` 'tests.unit.test_tools.nope': module"),
    ],
)
def test_bad_tools_are_one_line(tool, message):
    with pytest.raises(ValueError, match=message):
        resolve_tools([tool])


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ValueError, match=r"`--data.tools` names two tools 'lookup'"):
        resolve_tools([lookup, lookup])


def test_hermes_reads_several_calls_and_reports_malformed_ones():
    text = (
        'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    )
    turn = hermes(text)
    assert (
        turn.calls == [ToolCall("lookup", {"city": "Oslo"}), ToolCall("add", {"a": 1, "b": 2})]
        and not turn.errors
    )
    assert not hermes("The answer is 5.").has_calls
    bad = hermes(
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{nope}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "y"'
    )
    assert bad.calls == [] and len(bad.errors) == 4 and bad.has_calls
    assert bad.errors[0] == "the arguments of 'x' must be a JSON object, got list"
    assert bad.errors[1].startswith(
        "a tool call is not valid JSON (Expecting property name enclosed in double quotes"
    )
    assert bad.errors[2].startswith('a tool call needs a "name" string')
    assert bad.errors[3] == 'a <tool_call> is not closed with </tool_call>: \'{"name": "y"\''


def test_llama3_json_and_mistral():
    turn = llama3_json(
        '<|python_tag|>{"name": "lookup", "parameters": {"city": "Oslo"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    )
    assert turn.calls == [ToolCall("lookup", {"city": "Oslo"}), ToolCall("add", {"a": 1, "b": 2})]
    assert not llama3_json("Oslo has 700k people.").has_calls
    assert (
        llama3_json('{"name": "lookup", "parameters": {"city": ')
        .errors[0]
        .startswith("a tool call is not valid JSON")
    )
    turn = mistral('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert (
        mistral("[TOOL_CALLS][{oops")
        .errors[0]
        .startswith("the [TOOL_CALLS] list is not valid JSON")
    )
    assert not mistral("plain").has_calls


def test_parsers_by_name_and_import_path():
    assert get_tool_parser("hermes") is hermes and sorted(TOOL_PARSERS) == [
        "hermes",
        "llama3_json",
        "mistral",
    ]
    # a user's function by import path
    assert get_tool_parser("tests.unit.test_tools.lookup") is lookup
    with pytest.raises(
        ValueError,
        match=r"unknown `--model.rollout.tool_parser` 'qwen'; valid tool-call parsers: "
        r"\['hermes', 'llama3_json', 'mistral'\]",
    ):
        get_tool_parser("qwen")

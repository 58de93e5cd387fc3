"""What a model's own output can do to the run: nothing but earn an error message. A tool call
nested a thousand levels deep, a number of five thousand digits, a parser (the user's own) that
raises or returns the wrong thing, arguments past the length cap: each is the ``Error: ...`` the
model reads as a ``tool`` message, and its episode goes on. A tool that answers with 10 MB is cut
to the result budget before anything is tokenized, and the model is told so.

Played through the real rollout loop with the settings a run gets (``loop_kwargs`` of a
``RolloutConfig``), the model's turns planted by a scripted policy."""

from __future__ import annotations

import json

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules.config import RolloutConfig
from earl_lightning.modules.rollout_setup import loop_kwargs
from earl_lightning.rollout import EpisodeSpec, SamplingConfig, rollout
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.tasks.tools import resolve_tools
from tests.plugins import tools as plugin
from tests.plugins.scripted import Says

ASK = {"prompt": [{"role": "user", "content": "What is 2+3?"}]}
DEEP = "[" * 1000 + "]" * 1000  # about 2,000 characters: RecursionError in json.loads
HUGE = "7" * 5000  # ValueError: past Python's int-string conversion limit (4,300 digits)
# each parser's way of writing {"name": "add", "arguments": <args>}
FORMATS = {
    "hermes": lambda args: f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>',
    "llama3_json": lambda args: f'{{"name": "add", "parameters": {args}}}',
    "mistral": lambda args: f'[TOOL_CALLS][{{"name": "add", "arguments": {args}}}]',
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(make_tiny_model("earl-tiny")))


def play(tok, turns, parser="hermes", tools=(plugin.add,), **settings):
    """One episode of ``ASK`` whose model says ``turns`` in order, under the run's settings."""
    cfg = RolloutConfig(tool_parser=parser, **{"max_context_tokens": 16384} | settings)
    spec = EpisodeSpec(None, seed=0, group_id=0, episode_id=0, row=ASK, row_index=0)
    (ep,) = rollout(
        [spec],
        PolicyBackend({0: Says(*turns)}, tok),
        tok,
        SamplingConfig(max_new_tokens=8192),
        **loop_kwargs(cfg, resolve_tools(list(tools))) | {"max_turns": 4},
    )
    return ep


def tool_messages(ep) -> list[str]:
    return [m["content"] for m in ep.messages if m["role"] == "tool"]


def assert_answered_and_went_on(ep, *starts: str) -> None:
    """The episode read one error per bad call, then a good call's result, and finished."""
    assert ep.error is None and ep.done and not ep.truncated
    got = tool_messages(ep)
    assert len(got) == len(starts) + 1 and got[-1] == "5", got
    for text, start in zip(got, starts):
        assert text.startswith(start), (text[:200], start)
    assert ep.tool_errors == len(starts) and ep.messages[-1] == {
        "role": "assistant",
        "content": "5",
    }


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_a_call_nested_a_thousand_levels_deep_is_an_error_message(tok, parser):
    write = FORMATS[parser]
    good = write(json.dumps({"a": 2, "b": 3}))
    ep = play(tok, [write(f'{{"a": {DEEP}, "b": 1}}'), good, "5"], parser)
    assert_answered_and_went_on(ep, "Error: ")
    assert "RecursionError" in tool_messages(ep)[0] or "deep" in tool_messages(ep)[0]


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_a_five_thousand_digit_number_is_an_error_message(tok, parser):
    write = FORMATS[parser]
    good = write(json.dumps({"a": 2, "b": 3}))
    ep = play(tok, [write(f'{{"a": {HUGE}, "b": 1}}'), good, "5"], parser)
    assert_answered_and_went_on(ep, "Error: ")
    assert "digits" in tool_messages(ep)[0]


def test_arguments_given_as_a_deep_json_string_are_an_error_message(tok):
    inner = json.dumps(f'{{"a": {DEEP}, "b": 1}}')  # the arguments as a string of JSON
    good = FORMATS["hermes"](json.dumps({"a": 2, "b": 3}))
    ep = play(tok, [FORMATS["hermes"](inner), good, "5"])
    assert_answered_and_went_on(ep, "Error: ")


@pytest.mark.parametrize(
    "parser, message",
    [
        (
            "tests.plugins.tools.raising_parser",
            "Error: the tool-call parser 'tests.plugins.tools.raising_parser' raised RuntimeError: "
            "this parser is broken",
        ),
        (
            "tests.plugins.tools.untyped_parser",
            "Error: the tool-call parser 'tests.plugins.tools.untyped_parser' returned dict, not a "
            "ParsedTurn",
        ),
    ],
)
def test_a_users_parser_that_fails_is_an_error_message_and_the_episode_goes_on(
    tok, parser, message
):
    ep = play(tok, ['<tool_call>{"name": "add"}</tool_call>', "5"], parser)
    assert ep.error is None and ep.done and tool_messages(ep) == [message]
    assert ep.tool_errors == 1 and ep.messages[-1] == {"role": "assistant", "content": "5"}


def test_arguments_past_the_cap_or_nested_too_deep_are_not_run(tok):
    write = FORMATS["hermes"]
    long_args = json.dumps({"a": 1, "b": 2, "pad": "y" * 300})
    nested = '{"a": ' + "[" * 40 + "]" * 40 + ', "b": 1}'  # parses fine, but 41 levels deep
    turns = [write(long_args), write(nested), write(json.dumps({"a": 2, "b": 3})), "5"]
    ep = play(tok, turns, max_tool_argument_chars=200)
    assert_answered_and_went_on(
        ep,
        "Error: the arguments of 'add' are 327 characters of JSON; at most 200 are read "
        "(`--model.rollout.max_tool_argument_chars`)",
        "Error: the arguments of 'add' nest deeper than 32 levels",
    )


def test_a_ten_megabyte_result_is_cut_to_the_budget_before_tokenizing_and_said(tok):
    write = FORMATS["hermes"]
    turns = [
        '<tool_call>{"name": "flood", "arguments": {"size": 10000000}}</tool_call>',
        write(json.dumps({"a": 2, "b": 3})),
        "5",
    ]
    ep = play(tok, turns, tools=(plugin.flood, plugin.add), max_tool_result_chars=1000)
    flood, added = tool_messages(ep)
    assert flood == "x" * 1000 + "\n[... truncated 9999000 characters]" and added == "5"
    assert ep.tool_truncated == 1 and ep.tool_errors == 0 and ep.done and not ep.truncated
    assert len(ep.token_ids) < 3000, "only the budget was tokenized into the episode"


def test_the_default_result_budget_is_the_settings(tok):
    ep = play(
        tok,
        ['<tool_call>{"name": "flood", "arguments": {"size": 10000000}}</tool_call>', "done"],
        tools=(plugin.flood,),
        max_context_tokens=65536,
    )
    budget = RolloutConfig().max_tool_result_chars
    (flood,) = tool_messages(ep)
    assert flood == "x" * budget + f"\n[... truncated {10_000_000 - budget} characters]"
    assert ep.tool_truncated == 1


def test_a_result_that_cannot_be_written_as_text_is_an_error_message(tok):
    turns = [
        '<tool_call>{"name": "bignum", "arguments": {"digits": 5000}}</tool_call>',
        '<tool_call>{"name": "deep", "arguments": {"levels": 5000}}</tool_call>',
        FORMATS["hermes"](json.dumps({"a": 2, "b": 3})),
        "5",
    ]
    ep = play(tok, turns, tools=(plugin.bignum, plugin.deep, plugin.add))
    assert_answered_and_went_on(
        ep,
        "Error: 'bignum' returned a value of type int that cannot be written as text (ValueError)",
        "Error: 'deep' returned a value of type list that cannot be written as text (RecursionError)",
    )

"""`earl sft` on rows in TRL's / Hugging Face's tool-calling form: an assistant message with
structured ``tool_calls`` trains on the text the model writes for it, exactly the tokens the
rollout makes of the same turn (the chat template's render, read back by the rollout's parser),
on every built-in template; ``tool`` messages are not trained on; several calls in a turn work;
what cannot be rendered so is one line naming the row and message."""

from __future__ import annotations

import json

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.models.tiny import PRESETS
from earl_lightning.rollout import EpisodeSpec, SamplingConfig, rollout
from earl_lightning.rollout.chat import ChatDeltas
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.loop import ToolUse
from earl_lightning.rollout.transcripts import sft_row
from earl_lightning.sft.datamodule import dataset_training_rows
from earl_lightning.tasks.rows import BadRowError
from earl_lightning.tasks.tool_parsers import hermes
from earl_lightning.tasks.tools import resolve_tools
from tests.plugins import tools as plugin
from tests.plugins.scripted import Says

# one preset of each built-in chat template (tokenizer, template): the others share theirs
TEMPLATES = {}
for _name, _spec in PRESETS.items():
    TEMPLATES.setdefault((_spec.get("tokenizer", "char"), _spec.get("chat_template")), _name)
PRESET_PER_TEMPLATE = sorted(TEMPLATES.values())
TOOLS = resolve_tools([plugin.add, plugin.nap])
SCHEMAS = [t.schema for t in TOOLS]


def structured(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def written(name: str, **arguments) -> str:
    """A call as the built-in templates write one (the Hermes format)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


QUESTION = {"role": "user", "content": "What are 2+3 and 4+5?"}
TWO_CALLS = [
    QUESTION,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [structured("add", a=2, b=3), structured("add", a=4, b=5)],
    },
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "tool", "name": "add", "content": "9"},
    {"role": "assistant", "content": "5 and 9"},
]


@pytest.fixture(scope="module", params=PRESET_PER_TEMPLATE)
def tok(request):
    return load_tokenizer(str(make_tiny_model(request.param)))


def played(tok, *turns: str, system_prompt: str | None = None):
    """The episode the rollout makes of a row asking QUESTION, the model writing ``turns``."""
    spec = EpisodeSpec(None, seed=0, group_id=0, episode_id=0, row={"prompt": [QUESTION]})
    (ep,) = rollout(
        [spec],
        PolicyBackend({0: Says(*turns)}, tok),
        tok,
        SamplingConfig(max_new_tokens=256),
        max_turns=4,
        max_context_tokens=4096,
        system_prompt=system_prompt,
        tools=ToolUse(hermes, tuple(TOOLS)),
    )
    return ep


def test_several_structured_calls_in_a_turn_are_the_rollouts_tokens(tok):
    ids, mask = sft_row({"messages": TWO_CALLS}, ChatDeltas(tok, SCHEMAS), None, "row 0", "hermes")
    ep = played(tok, written("add", a=2, b=3) + "\n" + written("add", a=4, b=5), "5 and 9")
    assert ep.tool_calls == 2 and ep.tool_errors == 0, "the rollout ran both calls"
    assert ids == ep.token_ids and mask == ep.action_mask
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == (
        written("add", a=2, b=3) + "\n" + written("add", a=4, b=5) + "<|im_end|>5 and 9<|im_end|>"
    ), "the calls carry the loss; the tool results do not"


def test_a_prompt_completion_row_with_a_call_and_a_system_prompt_is_the_rollouts(tok):
    row = {
        "prompt": [QUESTION],
        "completion": [
            {"role": "assistant", "content": "", "tool_calls": [structured("add", a=2, b=3)]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "5"},
        ],
    }
    ids, mask = sft_row(row, ChatDeltas(tok, SCHEMAS), "Be brief.", "row 0", "hermes")
    ep = played(tok, written("add", a=2, b=3), "5", system_prompt="Be brief.")
    assert ids == ep.token_ids and mask == ep.action_mask


def test_the_labels_cover_the_call_tokens(tok):
    (row,) = dataset_training_rows([{"messages": TWO_CALLS}], tok, None, SCHEMAS, "hermes")
    labelled = [t for t in row["labels"] if t != -100]
    call = tok.encode(written("add", a=2, b=3), add_special_tokens=False)
    assert any(labelled[i : i + len(call)] == call for i in range(len(labelled))), (
        "the call's tokens are labelled"
    )
    assert "<tool_response>" not in tok.decode(labelled), "the tool results are not"


@pytest.mark.parametrize(
    "messages, parser, tools, message",
    [
        (
            TWO_CALLS,
            "mistral",
            SCHEMAS,
            r"^row 7: `messages`, message 1: the chat template writes its tool_calls as "
            r"'<tool_call>.*, which the `--model.rollout.tool_parser` 'mistral' parser reads as "
            r"\[\], not \[\('add', \{'a': 2, 'b': 3\}\), \('add', \{'a': 4, 'b': 5\}\)\]; set the "
            r"parser of this template's tool-call format$",
        ),
        (
            TWO_CALLS,
            None,
            SCHEMAS,
            r"^row 7: `messages`, message 1 calls \['add', 'add'\], and "
            r"`--model.rollout.tool_parser` is null: set the parser",
        ),
        (
            TWO_CALLS,
            "hermes",
            None,
            r"^row 7: `messages`, message 1 calls \['add'\], which the prompt does not offer "
            r"\(its tools: \[\]\): name the tools in `--data.tools`",
        ),
        (
            [QUESTION, {"role": "assistant", "content": "", "tool_calls": [{"name": "add"}]}],
            "hermes",
            SCHEMAS,
            r"^row 7: `messages`, message 1: tool call 0 must be \{'type': 'function', 'function': "
            r"\{'name': <string>, 'arguments': <JSON object>\}\}, got \{'name': 'add'\}$",
        ),
        (
            [{**QUESTION, "tool_calls": [structured("add", a=1, b=2)]}, TWO_CALLS[-1]],
            "hermes",
            SCHEMAS,
            r"^row 7: `messages`, message 0: a user message carries `tool_calls`; only an "
            r"assistant message calls tools$",
        ),
    ],
    ids=["wrong_parser", "no_parser", "tool_not_offered", "no_arguments", "user_calls"],
)
def test_a_call_that_cannot_be_rendered_as_the_rollout_would_is_one_line(
    tok, messages, parser, tools, message
):
    with pytest.raises(ValueError, match=message):
        sft_row({"messages": messages}, ChatDeltas(tok, tools), None, "row 7", parser)


def test_a_bad_row_met_while_encoding_is_a_bad_row_error(tok):
    with pytest.raises(BadRowError, match=r"`--data.dataset` row 0: `messages`, message 1"):
        dataset_training_rows([{"messages": TWO_CALLS}], tok, None, SCHEMAS, "mistral")

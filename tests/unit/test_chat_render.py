"""The rollout's chat renders run the tokenizer's compiled template directly
(``earl_lightning/rollout/chat.py``: ``direct_renderer``): on every built-in template, with and
without tools, with tool calls and results, with and without the generation prompt, the text is
``apply_chat_template``'s; a direct render that disagrees on the first render is dropped for
``apply_chat_template``, and one that cannot be had leaves every render to it."""

from __future__ import annotations

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import chat as chat_mod
from earl_lightning.rollout.chat import ChatDeltas, direct_renderer
from tests.unit.test_sft_tool_calls import PRESET_PER_TEMPLATE, SCHEMAS

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        ],
    },
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "<think>add</think>It is 5."},
    {"role": "user", "content": "And 4 + 4?"},
]


@pytest.mark.parametrize("preset", PRESET_PER_TEMPLATE)
@pytest.mark.parametrize("tools", [None, SCHEMAS])
def test_direct_renders_equal_apply_chat_template(preset, tools):
    tok = load_tokenizer(str(make_tiny_model(preset)))
    render = direct_renderer(tok, tools)
    assert render is not None
    for n in range(1, len(CHAT) + 1):
        for gp in (False, True):
            want = tok.apply_chat_template(
                CHAT[:n], tools=tools, tokenize=False, add_generation_prompt=gp
            )
            assert render(CHAT[:n], gp) == want


def test_a_direct_render_that_disagrees_is_dropped(monkeypatch):
    tok = load_tokenizer(str(make_tiny_model("earl-tiny")))
    monkeypatch.setattr(chat_mod, "direct_renderer", lambda tokenizer, tools: lambda m, gp: "x")
    chat = ChatDeltas(tok)
    for n in (2, 4, 6):
        want = tok.apply_chat_template(CHAT[:n], tokenize=False, add_generation_prompt=True)
        assert chat.prompt(CHAT[:n]) == want
    assert chat._direct is None


def test_a_tokenizer_without_a_template_to_compile_renders_through_its_own_method():
    """A duck-typed tokenizer (``apply_chat_template``, ``encode``; no ``get_chat_template``)."""
    real = load_tokenizer(str(make_tiny_model("earl-tiny")))

    class Minimal:
        chat_template = real.chat_template
        apply_chat_template = staticmethod(real.apply_chat_template)

    assert direct_renderer(Minimal(), None) is None
    chat = ChatDeltas(Minimal())
    want = real.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert chat.prompt(CHAT[:2]) == want and chat._direct is None

"""What a run shows of its episodes: a transcript names what the episode was made from (the
environment and seed, or the row's columns), marks each tool call and each error the model was
shown; the episodes shown are the ones asked for; the first prompt comes with what the tools'
schemas cost; the deprecated flag still works; the learning-signal check warns once, after its
patience; the presets' listed sizes are the models' own."""

from __future__ import annotations

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.models.tiny import preset_table
from earl_lightning.modules.signal import LearningSignal
from earl_lightning.modules.transcripts import (
    EarlDeprecationWarning,
    TranscriptConfig,
    format_prompt,
    format_transcript,
    pick,
    transcript_settings,
)
from earl_lightning.rollout import EpisodeSpec, SamplingConfig, rollout
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.loop import ToolUse
from earl_lightning.tasks.tool_parsers import hermes
from earl_lightning.tasks.tools import resolve_tools
from tests.plugins import tools as plugin
from tests.plugins.scripted import Says

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(make_tiny_model("earl-tiny-bpe")))


def calculator(tok, *turns: str):
    spec = EpisodeSpec("calculator", seed=3, group_id=0, episode_id=0)
    (ep,) = rollout(
        [spec],
        PolicyBackend({0: Says(*turns)}, tok),
        tok,
        SamplingConfig(max_new_tokens=96),
        max_turns=4,
        max_context_tokens=4096,
        tools=ToolUse(hermes),
    )
    return ep


def test_a_tool_call_and_an_error_are_marked(tok):
    ep = calculator(tok, CALL % "1/0", CALL % "2+2", "4")
    text = format_transcript(ep)
    head = text.splitlines()[0]
    assert head.startswith("**env** calculator **seed** 3 **reward** ")
    assert "**tool calls** 2 (**0 failed**)" in head, "the tool answered both (one with its error)"
    assert '**assistant** calls `calculate({"expression": "1/0"})`:' in text
    assert "**tool** `calculate` **ERROR**:\n\n    Error: division by zero" in text
    assert '**assistant** calls `calculate({"expression": "2+2"})`:' in text
    assert "**tool** `calculate`:\n\n    4" in text


def test_a_dataset_row_shows_its_columns_not_an_env(tok):
    spec = EpisodeSpec(
        None,
        seed=0,
        group_id=0,
        episode_id=0,
        row={"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"},
        row_index=7,
    )
    (ep,) = rollout(
        [spec],
        PolicyBackend(
            {0: Says('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>', "5")}, tok
        ),
        tok,
        SamplingConfig(max_new_tokens=64),
        max_turns=3,
        max_context_tokens=4096,
        tools=ToolUse(hermes, tuple(resolve_tools([plugin.add]))),
    )
    text = format_transcript(ep)
    assert text.splitlines()[0].startswith('**row** 7: answer=`"5"` **reward** +0.00')
    assert "env" not in text.splitlines()[0]
    assert "(**1 failed**)" in text.splitlines()[0]
    assert (
        "**tool** `add` **ERROR**:\n\n    Error: bad arguments for 'add': missing required" in text
    )


def test_the_first_prompt_says_what_the_tools_schemas_cost(tok):
    ep = calculator(tok, "4")
    text = format_prompt(ep, tok)
    bare = tok.apply_chat_template(ep.messages[:1], tokenize=False, add_generation_prompt=True)
    cost = ep.prompt_tokens - len(tok.encode(bare, add_special_tokens=False))
    assert cost > 100, "the calculator's schema is most of its prompt"
    assert text.startswith(
        f"The first prompt, as the model reads it: {ep.prompt_tokens} tokens, of which the tools' "
        f"schemas take {cost}."
    )
    assert '"name": "calculate"' in text


class _Ep:
    def __init__(self, i: int, reward: float, error: str | None = None) -> None:
        self.i, self.reward, self.error = i, reward, error
        self.invalid_action = self.truncated = False
        self.tool_errors = 0


@pytest.mark.parametrize(
    "episodes, n, expected",
    [("first", 2, [0, 1]), ("failed", 3, [1, 3]), ("best", 2, [2, 3]), ("worst", 1, [1])],
)
def test_the_episodes_shown_are_the_ones_asked_for(episodes, n, expected):
    eps = [_Ep(0, 0.5), _Ep(1, -1.0), _Ep(2, 1.0), _Ep(3, 0.7, error="boom")]
    chosen = pick(eps, TranscriptConfig(episodes=episodes, n=n), seed=0)
    assert [ep.i for ep in chosen] == expected
    drawn = pick(eps, TranscriptConfig(episodes="random", n=2), seed=5)
    assert drawn == pick(eps, TranscriptConfig(episodes="random", n=2), seed=5) and len(drawn) == 2


def test_the_old_transcript_flag_works_and_names_the_new_one():
    with pytest.warns(EarlDeprecationWarning, match=r"use `--model.transcripts.every_n_steps`"):
        config = transcript_settings({"episodes": "failed"}, 5)
    assert config == TranscriptConfig(every_n_steps=5, episodes="failed")


def test_the_learning_signal_check_warns_once_after_its_patience():
    signal = LearningSignal(patience=3)
    said = [signal.update(1.0, 0.2) for _ in range(6)]
    assert [s is not None for s in said] == [False, False, True, False, False, False]
    assert signal.streak == 6
    assert signal.update(0.5, 0.3) is None and signal.streak == 0, "a step with signal resets it"
    still = LearningSignal(patience=2)
    assert still.update(0.5, 0.0) is None
    assert "the gradient norm was 0" in still.update(0.25, 0.0)
    assert LearningSignal(patience=0).update(1.0, 0.0) is None


@pytest.mark.parametrize("name", ["earl-tiny", "earl-tiny-bpe-4l"])
def test_the_presets_listed_sizes_are_the_models(name):
    from transformers import AutoModelForCausalLM

    (row,) = [r for r in preset_table() if r["name"] == name]
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(name))
    assert row["parameters"] == sum(p.numel() for p in model.parameters())
    assert row["layers"] == model.config.num_hidden_layers
    assert row["tokenizer"].endswith(f"{model.config.vocab_size} ids")


def test_a_compact_schema_costs_fewer_tokens_and_keeps_what_a_call_needs(tok):
    def played(form: str):
        spec = EpisodeSpec("calculator", seed=3, group_id=0, episode_id=0)
        (ep,) = rollout(
            [spec],
            PolicyBackend({0: Says(CALL % "2+2", "4")}, tok),
            tok,
            SamplingConfig(max_new_tokens=96),
            max_turns=4,
            max_context_tokens=4096,
            tools=ToolUse(hermes, (), form),
        )
        return ep

    full, compact = played("full"), played("compact")
    assert compact.prompt_tokens < full.prompt_tokens - 30
    shown = tok.decode(compact.token_ids[: compact.prompt_tokens])
    assert '"name": "calculate"' in shown and '"required": ["expression"]' in shown
    assert "Evaluate an arithmetic expression exactly." in shown, "the tool's own description stays"
    assert "parentheses" not in shown and '"return"' not in shown
    assert compact.tool_calls == 1 and compact.tool_errors == 0, "the call still works"

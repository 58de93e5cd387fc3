"""`earl sft` on a dataset trains on the very token sequences the RL rollout makes: a written
conversation rendered piece by piece equals the episode a scripted policy plays with the same
words, with the same assistant-token mask."""

from __future__ import annotations

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, SamplingConfig, rollout
from earl_lightning.rollout.chat import ChatDeltas
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.transcripts import sft_row
from earl_lightning.sft.datamodule import dataset_training_rows, eval_prompt_row


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(make_tiny_model("earl-tiny")))


class _Says:
    def __init__(self, *words):
        self.words = list(words)

    def __call__(self, observation):
        return self.words.pop(0)


def _episode(tok, row, env, *words, system_prompt=None):
    spec = EpisodeSpec(env, seed=0, group_id=0, episode_id=0, row=row)
    (ep,) = rollout(
        [spec],
        PolicyBackend({0: _Says(*words)}, tok),
        tok,
        SamplingConfig(max_new_tokens=8),
        max_turns=5,
        max_context_tokens=512,
        system_prompt=system_prompt,
    )
    return ep


def test_a_prompt_completion_row_is_the_rollouts_episode(tok):
    prompt = [{"role": "user", "content": "2+3="}]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "5"}]}
    ids, mask = sft_row(row, ChatDeltas(tok), "Be brief.", "row 0")
    ep = _episode(tok, {"prompt": prompt}, None, "5", system_prompt="Be brief.")
    assert ids == ep.token_ids and mask == ep.action_mask
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "5<|im_end|>", (
        "the answer and the eos that ends it"
    )


def test_a_multi_turn_messages_row_is_the_rollouts_episode(tok):
    messages = [
        {"role": "user", "content": "Hi. Count down from 3."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2. Next?"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "1. Next?"},
        {"role": "assistant", "content": "0"},
    ]
    ids, mask = sft_row({"messages": messages}, ChatDeltas(tok), None, "row 0")
    ep = _episode(
        tok,
        {"prompt": [{"role": "user", "content": "Hi."}], "start": 3},
        "tests.plugins.rewards.CountDown",
        "2",
        "1",
        "0",
    )
    assert ep.messages == messages
    assert ids == ep.token_ids and mask == ep.action_mask
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "2<|im_end|>1<|im_end|>0<|im_end|>"


def test_a_standard_row_is_plain_text_then_eos(tok):
    ids, mask = sft_row({"prompt": "2+3=", "completion": "5"}, ChatDeltas(tok), None, "row 0")
    ep = _episode(tok, {"prompt": "2+3="}, None, "5")
    assert ids == ep.token_ids and mask == ep.action_mask
    assert tok.decode(ids) == "2+3=5<|im_end|>"


def test_only_the_completions_assistant_turns_are_labelled(tok):
    row = {
        "prompt": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        "completion": [{"role": "assistant", "content": "d"}],
    }
    (out,) = dataset_training_rows([row], tok, None)
    labelled = tok.decode([t for t in out["labels"] if t != -100])
    assert labelled == "d<|im_end|>"
    played = eval_prompt_row({"messages": [*row["prompt"], *row["completion"]]})
    assert played["prompt"] == row["prompt"][:1], (
        "a conversation is evaluated from its first user turn: the model plays the rest"
    )


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
            r"row 3: `prompt` and `completion` must "
            r"both be strings .* or both lists",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}]},
            r"row 3: `messages` has no assistant message",
        ),
        ({"messages": "a"}, r"row 3: `messages` must be a non-empty list of messages"),
    ],
)
def test_bad_rows_are_one_line(tok, row, message):
    with pytest.raises(ValueError, match=message):
        sft_row(row, ChatDeltas(tok), None, "row 3")

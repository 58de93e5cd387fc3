"""A real (byte-level BPE) tokenizer through the rollout: ``earl-tiny-bpe`` merges characters, so
the rollout's joins (the prompt, each generated turn, the template's scaffolding, each encoded on
its own) could differ from the tokenization of the whole transcript. On every built-in task and on
the tool-calling ones the episode's tokens are exactly the tokenizer's encoding of the chat
template's render of its whole transcript; where a turn's own tokens cannot be (an answer that
starts with a newline merges with the generation prompt's; a model may sample any tokenization of
a text) the generated tokens are kept as generated, the sequence still decodes to the render, and
the action mask covers exactly the generated tokens."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from earl_lightning.envs import make_env
from earl_lightning.envs.policies import ImperfectCalculator, ImperfectInventory, RandomLegal
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.rollout.backends.base import GenOutput
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.loop import ToolUse
from earl_lightning.tasks.tool_parsers import hermes
from earl_lightning.tasks.tools import tool_of

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    tok = load_tokenizer(str(make_tiny_model("earl-tiny-bpe")))
    assert len(tok.encode("You are o. Opponent played", add_special_tokens=False)) < 10, (
        "merges are applied"
    )
    return tok


class Says:
    """A scripted player: its words in turn, then the last one again."""

    def __init__(self, *words: str) -> None:
        self.words = list(words)

    def __call__(self, observation: str) -> str:
        return self.words.pop(0) if len(self.words) > 1 else self.words[0]


class Squares:
    """TextArena Tic Tac Toe: a random square, written as the game asks ([4])."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, observation: str) -> str:
        return f"[{self.rng.randrange(9)}]"


# task: (env, env kwargs, the player of episode `seed`, a row)
TASKS = {
    "connect_four": ("connect_four", {"opponent": "random"}, RandomLegal, None),
    "tic_tac_toe": ("openspiel", {"game": "tic_tac_toe"}, RandomLegal, None),
    "hex": ("openspiel", {"game": "hex(board_size=3)"}, RandomLegal, None),
    "recall": (
        "recall",
        {"num_turns": 4, "padding_chars": 20},
        lambda s: Says("7", "it was 3", "0"),
        None,
    ),
    "textarena": ("textarena", {}, Squares, None),
    "calculator, text": (
        "calculator",
        {"protocol": "text"},
        lambda s: ImperfectCalculator(s, no_tool_share=0.3, protocol="text"),
        None,
    ),
    "calculator, tools": (
        "calculator",
        {},
        lambda s: ImperfectCalculator(s, no_tool_share=0.3),
        None,
    ),
    "inventory, tools": ("inventory", {}, ImperfectInventory, None),
    "dataset row": (
        None,
        {},
        lambda s: Says(f"The answer is {s + 4}."),
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2? Say: The answer is N."},
            ]
        },
    ),
}


def play(tok, task: str, n: int = 4, backend=None, **kw):
    env, env_kwargs, player, row = TASKS[task]
    specs = [
        EpisodeSpec(env, seed=s, group_id=s, episode_id=s, env_kwargs=env_kwargs, row=row)
        for s in range(n)
    ]
    backend = backend or PolicyBackend({s: player(s) for s in range(n)}, tok)
    kw = dict(max_turns=6, max_context_tokens=4096) | kw
    return rollout(
        specs, backend, tok, SamplingConfig(max_new_tokens=96), tools=ToolUse(hermes), **kw
    )


def schemas(task: str):
    env, env_kwargs, _, _ = TASKS[task]
    tools = make_env(env, **env_kwargs).tools() if task.endswith("tools") else []
    return [tool_of(t, "the environment's tools").schema for t in tools] or None


def render(tok, ep, tools) -> str:
    return tok.apply_chat_template(ep.messages, tools=tools, tokenize=False)


def generated_runs(ep) -> list[list[int]]:
    """The maximal runs of action-mask-1 tokens, in order."""
    runs, prev = [], 0
    for t, m in zip(ep.token_ids, ep.action_mask):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(t)
        prev = m
    return runs


def assert_mask_is_the_assistant_turns(tok, ep) -> None:
    """Each turn's masked tokens are one run that decodes to the assistant message (and the eos
    that ended it); nothing else is masked."""
    answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
    runs = generated_runs(ep)
    assert len(runs) == len(answers) == ep.num_turns
    assert [ep.token_ids[s] for s in ep.turn_starts] == [r[0] for r in runs]
    for run, answer in zip(runs, answers):
        assert tok.decode(run, skip_special_tokens=False) in (answer, answer + IM_END)


@pytest.mark.parametrize("task", list(TASKS))
def test_the_turn_by_turn_tokens_are_the_tokenization_of_the_whole_transcript(tok, task):
    episodes = play(tok, task)
    assert sum(ep.num_turns for ep in episodes) >= len(episodes) and all(
        ep.error is None for ep in episodes
    )
    if task.endswith("tools"):
        assert sum(ep.tool_calls for ep in episodes) > 0, "tools were called"
    for ep in episodes:
        whole = render(tok, ep, schemas(task))
        assert ep.token_ids == tok(whole, add_special_tokens=False)["input_ids"]
        generated = tok.decode(
            [t for t, m in zip(ep.token_ids, ep.action_mask) if m], skip_special_tokens=False
        )
        assert generated == "".join(
            m["content"] + IM_END for m in ep.messages if m["role"] == "assistant"
        )
        assert_mask_is_the_assistant_turns(tok, ep)


def test_an_answer_starting_with_newlines_keeps_its_own_tokens(tok):
    """The generation prompt ends with a newline and the answer starts with two: the whole render
    merges the three into other tokens than the prompt's and the answer's, and the episode keeps
    the tokens the turn generated (those its log-probabilities are of)."""
    row = {"prompt": [{"role": "user", "content": "Hi."}]}
    answer = "\n\nThe answer is 4."
    backend = PolicyBackend({0: Says(answer)}, tok)
    (ep,) = rollout(
        [EpisodeSpec(None, seed=0, group_id=0, episode_id=0, row=row)],
        backend,
        tok,
        SamplingConfig(max_new_tokens=32),
        max_turns=1,
        max_context_tokens=512,
    )
    whole = render(tok, ep, None)
    assert ep.token_ids != tok(whole, add_special_tokens=False)["input_ids"], (
        "BPE merges across the join"
    )
    assert tok.decode(ep.token_ids, skip_special_tokens=False) == whole
    own = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    assert [t for t, m in zip(ep.token_ids, ep.action_mask) if m] == own
    assert (
        ep.token_ids[: ep.prompt_tokens]
        == tok(render(tok, ep, None)[: -len(answer + IM_END + "\n")], add_special_tokens=False)[
            "input_ids"
        ]
    )


def test_a_plain_text_prompt_and_its_completion_keep_their_own_tokens(tok):
    """A row whose prompt is a string is played without a chat template: the prompt ends with a
    space that the whole text merges into the completion's first word."""
    backend = PolicyBackend({0: Says("kato.")}, tok)
    (ep,) = rollout(
        [EpisodeSpec(None, seed=0, group_id=0, episode_id=0, row={"prompt": "Say the word: "})],
        backend,
        tok,
        SamplingConfig(max_new_tokens=32),
        max_turns=1,
        max_context_tokens=512,
    )
    prompt = tok("Say the word: ", add_special_tokens=False)["input_ids"]
    completion = tok("kato.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ep.token_ids == prompt + completion != tok("Say the word: kato.<|im_end|>")["input_ids"]
    assert ep.action_mask == [0] * len(prompt) + [1] * len(completion)


class ByteByByte(PolicyBackend):
    """A 'model' that writes the policy's text one byte-level token per character: a tokenization
    of the text that is not the tokenizer's own."""

    def _one(self, request, sampling):
        text = self.policies[request.key](request.observation)
        ids = [
            self.tokenizer.convert_tokens_to_ids(ch)
            for piece in self.tokenizer.tokenize(text)
            for ch in piece
        ]
        ids += [self.tokenizer.eos_token_id]
        return GenOutput(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")


@pytest.mark.parametrize("task", ["recall", "inventory, tools"])
def test_a_tokenization_that_is_not_the_tokenizers_own_is_kept_as_generated(tok, task):
    player = TASKS[task][2]
    episodes = play(tok, task, n=3, backend=ByteByByte({s: player(s) for s in range(3)}, tok))
    for ep in episodes:
        whole = render(tok, ep, schemas(task))
        assert ep.token_ids != tok(whole, add_special_tokens=False)["input_ids"]
        assert tok.decode(ep.token_ids, skip_special_tokens=False) == whole
        assert_mask_is_the_assistant_turns(tok, ep)
        assert [lp for lp, m in zip(ep.logprobs, ep.action_mask) if m] == [-0.5] * sum(
            ep.action_mask
        )


@pytest.mark.parametrize("task", ["recall", "inventory, tools"])
def test_a_sampling_model_s_episodes_decode_to_their_render_and_mask_its_tokens(tok, task):
    """The earl-tiny-bpe model samples anything (special tokens, broken UTF-8, leading newlines)."""
    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_model("earl-tiny-bpe"))).eval()
    env, env_kwargs = TASKS[task][:2]
    specs = [
        EpisodeSpec(env, seed=s, group_id=s, episode_id=s, env_kwargs=env_kwargs) for s in range(4)
    ]
    with torch.no_grad():
        sampling = SamplingConfig(max_new_tokens=12, seed=1, temperature=1.5)
        episodes = rollout(
            specs,
            HFBackend(model, tok),
            tok,
            sampling,
            max_turns=3,
            max_context_tokens=4096,
            tools=ToolUse(hermes),
        )
    for ep in episodes:
        assert tok.decode(ep.token_ids, skip_special_tokens=False) == render(tok, ep, schemas(task))
        assert_mask_is_the_assistant_turns(tok, ep)

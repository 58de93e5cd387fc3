"""Dataset rows through the real rollout loop and the reward functions: a conversational row is
one chat turn, a string row is plain text, a row with an environment is an episode whose reset
gets the row's columns; the reward functions see TRL's forms and their sum joins the env's."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.scoring import score_episodes, transcript
from earl_lightning.tasks.rewards import resolve_reward_funcs
from tests.plugins.scripted import Says

CHAT_ROW = {"prompt": [{"role": "user", "content": "2+3="}], "answer": "5"}
TEXT_ROW = {"prompt": "2+3=", "answer": "5"}
ENV = "tests.plugins.rewards.CountDown"


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


def _spec(row, env=None, i=0, **kw):
    return EpisodeSpec(
        env, seed=10 + i, group_id=i, episode_id=i, row=row, row_index=i, env_kwargs=kw
    )


def _play(tok, specs, answers, **kw):
    """Play ``specs`` with a scripted policy that answers ``answers[i]`` then counts down."""
    policies = {
        s.episode_id: Says(*([a] if isinstance(a, str) else a)) for s, a in zip(specs, answers)
    }
    kw = dict(max_turns=5, max_context_tokens=512) | kw
    return rollout(specs, PolicyBackend(policies, tok), tok, SamplingConfig(max_new_tokens=8), **kw)


def test_a_conversational_row_is_one_chat_turn_scored_in_trls_form(lm):
    _, tok = lm
    (ep,) = _play(tok, [_spec(CHAT_ROW)], ["5"], system_prompt="Be brief.")
    assert ep.done and ep.num_turns == 1 and ep.error is None
    want = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            *CHAT_ROW["prompt"],
            {"role": "assistant", "content": "5"},
        ],
        tokenize=False,
    )
    assert tok.decode(ep.token_ids) == want
    prompt, completion, ids = transcript(ep, tok)
    assert prompt == [{"role": "system", "content": "Be brief."}, *CHAT_ROW["prompt"]]
    assert completion == [{"role": "assistant", "content": "5"}]
    assert ids == ep.token_ids[ep.prompt_tokens :] and ids[:1] == tok.encode(
        "5", add_special_tokens=False
    )


def test_a_string_row_is_plain_text_without_the_chat_template(lm):
    _, tok = lm
    (ep,) = _play(tok, [_spec(TEXT_ROW)], ["5"])
    assert tok.decode(ep.token_ids, skip_special_tokens=True) == "2+3=5"
    assert "<|im_start|>" not in tok.decode(ep.token_ids)
    assert ep.prompt_tokens == len(tok("2+3=")["input_ids"])
    assert transcript(ep, tok)[:2] == ("2+3=", "5")


def test_a_row_with_an_environment_gets_its_columns_at_reset(lm):
    _, tok = lm
    row = {"prompt": [{"role": "user", "content": "Hi."}], "start": 3, "unused": "x"}
    (ep,) = _play(tok, [_spec(row, ENV)], [["2", "1", "0"]])
    assert ep.messages[0]["content"] == "Hi. Count down from 3.", (
        "reset's text joins the last prompt message"
    )
    assert [m["role"] for m in ep.messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert ep.num_turns == 3 and ep.outcome == "win" and ep.reward == 1.0
    prompt, completion, ids = transcript(ep, tok)
    assert prompt == ep.messages[:1] and completion == ep.messages[1:], (
        "the whole transcript is the completion"
    )


def test_reward_functions_add_to_the_env_reward_on_the_last_turn(lm):
    _, tok = lm
    funcs = resolve_reward_funcs(
        ["tests.plugins.rewards.exact_sum", "tests.plugins.rewards.brevity"], [2.0, 1.0]
    )
    episodes = _play(
        tok, [_spec(CHAT_ROW, i=0), _spec(CHAT_ROW, i=1), _spec(TEXT_ROW, i=2)], ["5", "7", "5"]
    )
    score_episodes(episodes, funcs, tok)
    assert [ep.rewards["exact_sum"] for ep in episodes] == [1.0, 0.0, 1.0]
    assert [ep.reward for ep in episodes] == pytest.approx([2 - 0.01, -0.01, 2 - 0.01])
    assert all(ep.turn_rewards == [ep.reward] for ep in episodes)
    row = {"prompt": [{"role": "user", "content": "Go."}], "start": 2, "answer": "0"}
    (ep,) = _play(tok, [_spec(row, ENV)], [["1", "0"]])
    score_episodes([ep], funcs, tok)
    # env + exact_sum (the last turn said 0) + brevity
    assert ep.reward == pytest.approx(1.0 + 2.0 * 1.0 - 0.01)
    assert ep.turn_rewards == pytest.approx([0.0, 3.0 - 0.01])


def test_rows_a_function_cannot_score_are_dropped_and_said_why(lm):
    _, tok = lm
    episodes = _play(
        tok, [_spec(CHAT_ROW, i=0), _spec({**CHAT_ROW, "answer": "6"}, i=1)], ["5", "6"]
    )
    score_episodes(
        episodes, resolve_reward_funcs(["tests.plugins.rewards.only_odd_rows"], None), tok
    )
    assert episodes[0].error is None and episodes[0].reward == 1.0
    assert episodes[1].error_kind == "unscored" and episodes[1].reward == 0.0
    episodes = _play(tok, [_spec(CHAT_ROW)], ["5"])
    score_episodes(episodes, resolve_reward_funcs(["tests.plugins.rewards.broken"], None), tok)
    assert episodes[0].error_kind == "reward"
    assert (
        episodes[0].error
        == "reward function 'broken' raised ValueError: this reward function is broken"
    )


def test_a_row_too_long_for_the_context_is_skipped_not_fatal(lm):
    _, tok = lm
    long_row = {"prompt": [{"role": "user", "content": "x" * 400}], "answer": "1"}
    episodes = _play(
        tok, [_spec(CHAT_ROW, i=0), _spec(long_row, i=1)], ["5", "5"], max_context_tokens=100
    )
    assert episodes[0].error is None
    assert episodes[1].error_kind == "row" and "row 1: its prompt is" in episodes[1].error
    assert sum(episodes[1].action_mask) == 0


def test_rows_play_through_the_hf_backend(lm):
    model, tok = lm
    specs = [_spec(CHAT_ROW, i=0), _spec(TEXT_ROW, i=1), _spec(CHAT_ROW, i=2)]
    episodes = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=6, seed=0),
        max_turns=3,
        max_context_tokens=512,
    )
    for ep in episodes:
        assert ep.num_turns == 1 and ep.done and 1 <= sum(ep.action_mask) <= 6
        assert ep.action_mask[: ep.prompt_tokens] == [0] * ep.prompt_tokens
    assert (
        episodes[0].token_ids[: episodes[0].prompt_tokens]
        == episodes[2].token_ids[: episodes[2].prompt_tokens]
    )
    assert episodes[1].prompt_tokens == len(tok("2+3=")["input_ids"])

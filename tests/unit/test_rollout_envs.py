"""The recall env, and rollouts over the built-in OpenSpiel and calculator environments."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from earl_lightning.envs.base import make_env
from earl_lightning.envs.recall import RecallEnv
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


def _ids(tok, messages):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))


# ---- recall ------------------------------------------------------------------------------
def test_recall_rewards_the_lagged_digit_and_lasts_num_turns():
    env = make_env("recall", num_turns=6, lag=2, padding_chars=30)
    obs = [env.reset(seed=5)]
    shown = [int(obs[0].split("Digit: ")[1][0])]
    total, results = 0.0, []
    for t in range(6):
        answer = (
            f"it was {shown[t - 2]}" if t >= 2 and t % 2 == 0 else ("no idea" if t == 3 else "7")
        )
        res = env.step(answer)
        results.append(res)
        total += res.reward
        if not res.done:
            obs.append(res.observation)
            shown.append(int(res.observation.split("Digit: ")[1][0]))
    assert [r.done for r in results] == [False] * 5 + [True]
    assert len({len(o) for o in obs}) == 1  # the context grows by the same amount every turn
    assert all(len(o.splitlines()[1]) == 30 for o in obs)
    assert results[2].reward == results[4].reward == pytest.approx(1 / 6)
    assert results[3].info == {"invalid_action": True, "correct": False}
    assert results[0].info["correct"] is None and results[1].info["correct"] is None
    expected_5 = results[5].reward > 0
    assert total == pytest.approx((2 + expected_5) / 6)
    assert results[5].info["outcome"] == "loss"


def test_recall_is_seeded_and_can_end_on_error():
    a, b = RecallEnv(num_turns=4, padding_chars=8), RecallEnv(num_turns=4, padding_chars=8)
    assert a.reset(3) == b.reset(3) and a.reset(3) != a.reset(4)
    env = RecallEnv(num_turns=5, lag=1, end_on_error=True)
    env.reset(0)
    env.step("0")  # first turn: anything goes
    wrong = (env.expected() + 1) % 10
    res = env.step(str(wrong))
    assert res.done and res.info["outcome"] == "loss" and res.reward == 0.0


def test_recall_all_correct_wins():
    env = RecallEnv(num_turns=3, lag=0)
    env.reset(1)
    rewards = [env.step(str(env.expected())) for _ in range(3)]
    assert sum(r.reward for r in rewards) == pytest.approx(1.0)
    assert rewards[-1].info["outcome"] == "win"
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("1")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_turns=0), r"`num_turns` must be a positive integer, got 0"),
        (dict(lag=-1), r"`lag` must be an integer >= 0, got -1"),
        (dict(num_turns=3, lag=3), r"`lag` of env 'recall' must be < num_turns=3, got 3"),
        (dict(padding_chars=2.5), r"`padding_chars` must be an integer >= 0, got 2.5"),
    ],
)
def test_recall_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_env("recall", **kwargs)


# ---- rollouts over the other built-in environments ----------------------------------------
def test_rollout_connect_four(lm):
    model, tok = lm
    specs = [
        EpisodeSpec(
            "connect_four", seed=s, group_id=0, episode_id=s, env_kwargs={"legal_move_reward": 0.02}
        )
        for s in range(8)
    ]
    episodes = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=12, seed=0, temperature=1.5),
        max_turns=6,
        max_context_tokens=8192,
    )
    assert max(ep.num_turns for ep in episodes) > 1  # random text often holds a legal column
    for ep in episodes:
        assert ep.error is None and ep.done != ep.truncated
        assert _ids(tok, ep.messages) == ep.token_ids
        if ep.invalid_action:
            assert ep.done and ep.outcome == "loss"
            assert ep.reward == pytest.approx(0.02 * (ep.num_turns - 1) - 1.0)
        elif ep.truncated:
            assert ep.num_turns == 6 and ep.reward == pytest.approx(0.02 * 6)


def test_rollout_calculator(lm):
    model, tok = lm
    specs = [EpisodeSpec("calculator", seed=s, group_id=s, episode_id=s) for s in range(4)]
    episodes = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=8, seed=1),
        max_turns=3,
        max_context_tokens=2048,
        system_prompt="Use the calculator.",
    )
    for ep in episodes:
        # A random-weight model writes neither calc(...) nor answer(N): one invalid turn.
        assert ep.done and ep.invalid_action and ep.num_turns == 1 and ep.reward == -1.0
        assert ep.messages[1]["content"].startswith("What is ")
        assert _ids(tok, ep.messages) == ep.token_ids

"""History windows (``history_turns``): each turn generated from [system] + the last k exchanges + the
current observation, trained as one row per turn that carries the return of the turns after it."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from earl_lightning.algorithms import discounted_returns
from earl_lightning.algorithms.estimators import get_advantage_estimator
from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules import AgenticRLModule
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.rollout.types import Episode
from earl_lightning.train.advantages import estimate_advantages
from earl_lightning.train.forward import fill_logprobs
from tests.unit.test_rollout_loop import _run, _specs


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


def _template(tok, messages):
    return list(
        tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )


@pytest.mark.parametrize("k", [0, 1])
def test_each_turn_is_generated_from_the_windowed_chat(lm, k):
    _, tok = lm
    episodes = _run(
        lm, _specs(4), SamplingConfig(max_new_tokens=3, seed=1, temperature=1.5), history_turns=k
    )
    for ep in episodes:
        assert ep.num_turns == 4 and len(ep.turn_prompts) == 4
        assert (
            list(tok.apply_chat_template(ep.messages, tokenize=True, return_dict=False))
            == ep.token_ids
        )
        for t, prompt in enumerate(ep.turn_prompts):
            before = ep.messages[
                1 : 1 + 2 * t + 1
            ]  # the chat up to turn t's observation, system excluded
            window = [ep.messages[0], *before[-(2 * k + 1) :]]
            assert prompt == _template(tok, window)
        assert len(ep.turn_prompts[3]) < ep.turn_starts[3]  # shorter than the whole chat


def test_a_window_covering_the_whole_chat_plays_exactly_the_whole_chat_rollout(lm):
    sampling = SamplingConfig(max_new_tokens=4, seed=5, temperature=1.3)
    whole = _run(lm, _specs(4), sampling)
    windowed = _run(lm, _specs(4), sampling, history_turns=10)
    for a, b in zip(whole, windowed):
        assert a.turn_prompts is None
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.reward == b.reward
        assert b.turn_prompts == [a.token_ids[:s] for s in a.turn_starts]


def test_turn_rows_logprobs_equal_the_trainer_recompute(lm):
    model, _ = lm
    episodes = _run(
        lm, _specs(6), SamplingConfig(max_new_tokens=5, seed=2, temperature=0.9), history_turns=0
    )
    exp = episodes_to_experience(episodes, gamma=0.9)
    assert exp.num_seqs == sum(ep.num_turns for ep in episodes)
    assert exp.seqs["turn_index"].tolist() == [k for ep in episodes for k in range(ep.num_turns)]
    exp = fill_logprobs(model, exp, name="old_logprobs", temperature=0.9, micro_batch_tokens=1024)
    mask = exp.tokens["action_mask"].bool()
    assert int(mask.sum()) == sum(ep.num_generated for ep in episodes)
    assert (
        float((exp.tokens["old_logprobs"] - exp.tokens["rollout_logprobs"])[mask].abs().max())
        < 1e-4
    )


def _episode(turn_prompts, gens, rewards, error=None) -> Episode:
    """A hand-made history-window episode: whole-chat tokens are prompt-free spans of gens."""
    from earl_lightning.rollout.types import EpisodeSpec

    ids, mask, lps, starts = [90], [0], [0.0], []
    for g in gens:
        starts.append(len(ids))
        ids += g + [91]
        mask += [1] * len(g) + [0]
        lps += [-0.5] * len(g) + [0.0]
    return Episode(
        spec=EpisodeSpec("recall", 0, 0, 7),
        token_ids=ids,
        action_mask=mask,
        logprobs=lps,
        reward=sum(rewards),
        num_turns=len(gens),
        done=True,
        truncated=False,
        invalid_action=False,
        outcome=None,
        error=error,
        turn_starts=starts,
        messages=[],
        turn_rewards=rewards,
        turn_prompts=turn_prompts,
    )


def test_turn_rows_carry_the_discounted_return_of_later_turns_by_hand():
    ep = _episode([[1, 2], [3], [4, 5, 6]], [[10, 11], [12], [13, 14]], [0.1, 0.2, 1.0])
    exp = episodes_to_experience([ep], gamma=0.5)
    rows = [exp.select([i]) for i in range(3)]
    assert [r.tokens["input_ids"].tolist() for r in rows] == [
        [1, 2, 10, 11],
        [3, 12],
        [4, 5, 6, 13, 14],
    ]
    assert [r.tokens["action_mask"].tolist() for r in rows] == [
        [0, 0, 1, 1],
        [0, 1],
        [0, 0, 0, 1, 1],
    ]
    assert rows[0].tokens["rollout_logprobs"].tolist() == [0, 0, -0.5, -0.5]
    # The episode's returns-to-go over its five generated tokens (one turn's tokens discount too):
    # token 14: 1.0; 13: 0.5; 12: 0.2 + 0.5 * 0.5 = 0.45; 11: 0.1 + 0.5 * 0.45 = 0.325; 10: 0.1625
    whole = []
    for r in rows:
        g = discounted_returns(
            r.padded("token_rewards", 0.0), r.padded("action_mask", 0.0), gamma=0.5
        )[0]
        whole += g[r.tokens["action_mask"].bool()].tolist()
    assert whole == pytest.approx([0.1625, 0.325, 0.45, 0.5, 1.0])
    assert (
        exp.seqs["rewards"].tolist() == pytest.approx([1.3] * 3)
        and exp.seqs["episode_ids"].tolist() == [7] * 3
    )
    failed = episodes_to_experience([_episode([[1], [2]], [[10], [11]], [0.0, 0.0], error="boom")])
    assert failed.tokens["action_mask"].sum() == 0 and failed.num_seqs == 2


def test_grpo_statistics_count_each_episode_once_however_many_turn_rows():
    long = _episode([[1]] * 5, [[10]] * 5, [0, 0, 0, 0, 1.0])
    short = _episode([[1]], [[10]], [-1.0])
    short.spec.episode_id = 8
    exp = episodes_to_experience([long, short])
    adv = estimate_advantages(
        exp, get_advantage_estimator("grpo"), {"scale": "group"}, num_groups=1
    ).tokens["advantages"]
    # two episodes, rewards 1 and -1: mean 0, unbiased std sqrt(2) -> +-0.7071 on every generated token
    got = adv[exp.tokens["action_mask"].bool()]
    assert got.tolist() == pytest.approx([2**-0.5] * 5 + [-(2**-0.5)], abs=1e-5)


def test_window_keeps_long_games_under_max_context_tokens(lm):
    model, tok = lm
    sampling = SamplingConfig(
        max_new_tokens=1,
        seed=0,
        temperature=1.0,
        allowed_token_ids=[tok.convert_tokens_to_ids(str(d)) for d in range(7)],
    )
    specs = [
        EpisodeSpec(
            "connect_four", seed=11, group_id=0, episode_id=0, env_kwargs={"opponent": "random"}
        )
    ]
    whole = rollout(
        specs, HFBackend(model, tok), tok, sampling, max_turns=21, max_context_tokens=4096
    )[0]
    assert whole.num_turns >= 4
    limit = whole.turn_starts[
        1
    ]  # the whole chat fits one turn only (turn 1 would need one more token)
    short = rollout(
        specs, HFBackend(model, tok), tok, sampling, max_turns=21, max_context_tokens=limit
    )[0]
    assert short.truncated and short.num_turns == 1
    windowed = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        sampling,
        max_turns=21,
        max_context_tokens=limit,
        history_turns=0,
    )[0]
    # the game is played to its end: every windowed prompt fits although the whole chat does not
    assert windowed.done and not windowed.truncated and windowed.num_turns > 1
    assert len(windowed.token_ids) > limit
    assert max(len(p) for p in windowed.turn_prompts) + 1 <= limit


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(rollout=dict(history_turns=-1)),
            r"`--model.rollout.history_turns` must be None \(the whole chat\) or an "
            r"integer >= 0 \(past exchanges kept in each turn's prompt\), got -1",
        ),
        (
            dict(rollout=dict(history_turns="2")),
            r"`--model.rollout.history_turns` must be None .*got '2'",
        ),
        (
            dict(
                rollout=dict(history_turns=0), algorithm=dict(advantage=dict(name="gae", lam=0.9))
            ),
            r"`--model.algorithm.advantage.lam` must be 1.0 with `--model.rollout.history_turns` \(0\), got 0.9",
        ),
        (
            dict(rollout=dict(history_turns=1), algorithm=dict(kl=dict(coef=0.1, in_reward=True))),
            r"`--model.algorithm.kl.in_reward` true is not supported with `--model.rollout.history_turns` \(1\)",
        ),
    ],
)
def test_bad_history_settings_are_rejected_at_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AgenticRLModule(**kwargs)


def test_rollout_rejects_a_bad_history_turns(lm):
    with pytest.raises(ValueError, match=r"`history_turns` must be None .*got 1.5"):
        _run(lm, _specs(1), SamplingConfig(max_new_tokens=1, seed=0), history_turns=1.5)

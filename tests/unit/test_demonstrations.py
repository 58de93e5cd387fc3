"""Demonstrations are played through the RL rollout loop: a policy that replays what the model
generated reproduces the model's episode token for token, mask for mask; the built-in policies
do what they say; a policy's bad answers are refused with errors that name it."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.envs import make_env
from earl_lightning.envs.policies import ImperfectCalculator, RandomLegal, make_policy
from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.rollout.demonstrations import (
    DemonstrationError,
    play_demonstrations,
    policy_seed,
)
from earl_lightning.rollout.loop import rollout
from earl_lightning.rollout.types import EpisodeSpec

DIGITS = [str(d) for d in range(7)]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("earl-tiny").eval(), load_tokenizer("earl-tiny")


class Replay:
    """Answers the k-th observation of an episode with what the model answered on its k-th turn
    (keyed by the policy's seed, which play_demonstrations derives from the episode's)."""

    answers: dict[int, list[str]] = {}

    def __init__(self, seed: int) -> None:
        self.queue = list(self.answers[seed])

    def __call__(self, observation: str) -> str:
        return self.queue.pop(0)


CASES = {
    "connect_four, one digit, history 0": (
        "connect_four",
        {"opponent": "random"},
        dict(max_new_tokens=1),
        DIGITS,
        0,
        None,
    ),
    "recall, free text with a stop string, whole chat": (
        "recall",
        {"num_turns": 4},
        dict(max_new_tokens=10, stop=["7"]),
        None,
        None,
        None,
    ),
    "recall, free text, system prompt, history 1": (
        "recall",
        {"num_turns": 4},
        dict(max_new_tokens=6),
        None,
        1,
        "Be brief.",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_replayed_model_episode_is_reproduced_token_for_token(case, tiny, monkeypatch):
    env, env_kwargs, sampling_kw, allowed, history, system = CASES[case]
    model, tok = tiny
    allowed_ids = [tok.encode(t, add_special_tokens=False)[0] for t in allowed] if allowed else None
    sampling = SamplingConfig(**sampling_kw, seed=3, allowed_token_ids=allowed_ids)
    specs = [
        EpisodeSpec(env, seed=s, group_id=s, episode_id=s, env_kwargs=env_kwargs) for s in range(6)
    ]
    kw = dict(max_turns=4, max_context_tokens=2048, system_prompt=system, history_turns=history)
    with torch.no_grad():
        played = rollout(specs, HFBackend(model, tok), tok, sampling, **kw)
    monkeypatch.setattr(
        Replay,
        "answers",
        {
            policy_seed(ep.spec.seed): [
                m["content"] for m in ep.messages if m["role"] == "assistant"
            ]
            for ep in played
        },
    )
    demos = play_demonstrations(
        specs, "tests.unit.test_demonstrations.Replay", None, tok, sampling, **kw
    )
    assert sum(ep.num_turns for ep in played) > 2 * len(specs)  # several turns were really played
    for ep, demo in zip(played, demos):
        assert demo.token_ids == ep.token_ids
        assert demo.action_mask == ep.action_mask
        assert demo.messages == ep.messages
        assert demo.turn_prompts == ep.turn_prompts
        assert (demo.reward, demo.invalid_action, demo.outcome) == (
            ep.reward,
            ep.invalid_action,
            ep.outcome,
        )


def test_demonstration_tokens_decode_to_the_chat_template_of_its_transcript(tiny):
    _, tok = tiny
    from earl_lightning.rollout.loop import ToolUse
    from earl_lightning.tasks.tool_parsers import hermes
    from earl_lightning.tasks.tools import tool_of

    specs = [EpisodeSpec("calculator", seed=s, group_id=s, episode_id=s) for s in range(4)]
    demos = play_demonstrations(
        specs,
        "imperfect_calculator",
        {"no_tool_share": 0.5},
        tok,
        SamplingConfig(max_new_tokens=96),
        max_turns=4,
        max_context_tokens=2048,
        tools=ToolUse(hermes),
    )
    schema = tool_of(make_env("calculator").calculate, "calculate").schema
    assert sum(ep.tool_calls for ep in demos) > 0
    for ep in demos:
        assert tok.decode(ep.token_ids, skip_special_tokens=False) == tok.apply_chat_template(
            ep.messages, tools=[schema], tokenize=False
        )
        generated = tok.decode(
            [t for t, m in zip(ep.token_ids, ep.action_mask) if m], skip_special_tokens=False
        )
        assert generated == "".join(
            m["content"] + "<|im_end|>" for m in ep.messages if m["role"] == "assistant"
        )
        assert all(lp == 0.0 for lp in ep.logprobs)


def test_random_legal_never_plays_an_illegal_move():
    env = make_env("connect_four", opponent="random")
    for seed in range(30):
        policy, obs = RandomLegal(seed), env.reset(seed)
        while True:
            result = env.step(policy(obs))
            assert not result.info["invalid_action"]
            if result.done:
                break
            obs = result.observation


def test_imperfect_calculator_skips_the_tool_on_its_share_and_is_then_wrong():
    from earl_lightning.tasks.tool_parsers import hermes

    env = make_env("calculator")
    used, correct = [], []
    for seed in range(400):
        policy, obs = ImperfectCalculator(seed, no_tool_share=0.3), env.reset(seed)
        action = policy(obs)
        calls = hermes(action).calls
        if calls:  # the calculator tool, called as the rollout would call it
            action = policy(env.calculate(**calls[0].arguments))
        result = env.step(action)
        used.append(result.info["tool_calls"] > 0)
        correct.append(result.info["correct"])
    # with the tool always right, without it always wrong
    assert all(c == u for c, u in zip(correct, used))
    assert 0.62 < sum(used) / len(used) < 0.78


def test_imperfect_calculator_states_its_mix_whatever_its_transcripts_show():
    """distribution() is the policy's own mix (the call with 1 - no_tool_share, each wrong answer
    an equal part of no_tool_share); shown_no_tool_share only changes how often the transcripts
    show the answer without the tool, and every action shown is one the distribution gives."""
    env = make_env("calculator")
    shown_without = []
    for seed in range(400):
        policy, obs = (
            ImperfectCalculator(seed, no_tool_share=0.75, shown_no_tool_share=0.1),
            env.reset(seed),
        )
        dist = policy.distribution(obs)
        call = [a for a in dist if a.startswith("<tool_call>")]
        assert len(call) == 1 and dist[call[0]] == pytest.approx(0.25)
        assert len(dist) == 19 and sum(dist.values()) == pytest.approx(1.0)
        assert all(p == pytest.approx(0.75 / 18) for a, p in dist.items() if a != call[0])
        assert str(env.answer) not in dist  # every answer without the tool is wrong
        action = policy(obs)
        assert action in dist
        shown_without.append(action != call[0])
    assert 0.06 < sum(shown_without) / len(shown_without) < 0.15
    result = ImperfectCalculator(0, no_tool_share=0.75).distribution("42")
    assert result == {"42": 1.0}  # the tool's result: answered as it is


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(no_tool_share=1.5), r"`no_tool_share` must be a number in \[0, 1\], got 1.5"),
        (dict(no_tool_share=0.0, shown_no_tool_share=0.2), r"`shown_no_tool_share` is 0.2 but"),
        (dict(no_tool_share=1.0, shown_no_tool_share=0.5), r"only show a branch the policy takes"),
        (dict(max_error=0), r"`max_error` must be a positive integer, got 0"),
    ],
)
def test_imperfect_calculator_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImperfectCalculator(0, **kwargs)


def test_policy_errors_name_the_policy_and_what_is_wrong(tiny):
    _, tok = tiny
    specs = [EpisodeSpec("connect_four", seed=0, group_id=0, episode_id=0)]
    one_digit = SamplingConfig(
        max_new_tokens=1,
        allowed_token_ids=[tok.encode(d, add_special_tokens=False)[0] for d in DIGITS],
    )
    kw = dict(max_turns=3, max_context_tokens=1024)
    with pytest.raises(
        DemonstrationError,
        match=r"'tests.unit.test_demonstrations.returns_int' returned 3 \(type int\)",
    ):
        play_demonstrations(
            specs, "tests.unit.test_demonstrations.returns_int", None, tok, one_digit, **kw
        )
    with pytest.raises(
        DemonstrationError,
        match=r"answered '12', which is 2 tokens, more than `sampling.max_new_tokens` = 1",
    ):
        play_demonstrations(
            specs, "tests.unit.test_demonstrations.answers_twelve", None, tok, one_digit, **kw
        )
    with pytest.raises(DemonstrationError, match=r"outside `sampling.allowed_tokens`: \['9'\]"):
        play_demonstrations(
            specs, "tests.unit.test_demonstrations.answers_nine", None, tok, one_digit, **kw
        )
    with pytest.raises(
        ValueError,
        match=r"unknown `--data.policy` 'random_legl'; valid demonstration policies: "
        r"\['centre_first', 'imperfect_calculator', 'imperfect_inventory', 'random_legal'\]",
    ):
        make_policy("random_legl", None, 0)
    with pytest.raises(
        ValueError, match=r"`--data.policy_kwargs` \{'no_tool_shar': 0.5\} do not fit"
    ):
        make_policy("imperfect_calculator", {"no_tool_shar": 0.5}, 0)
    with pytest.raises(ValueError, match=r"`no_tool_share` must be a number in \[0, 1\], got 1.5"):
        make_policy("imperfect_calculator", {"no_tool_share": 1.5}, 0)


def returns_int(observation: str):
    return 3


def answers_twelve(observation: str) -> str:
    return "12"


def answers_nine(observation: str) -> str:
    return "9"


def test_the_demonstrator_does_not_copy_the_seeded_random_opponent(tiny):
    """The env seeds its random opponent with the episode seed; a demonstrator seeded the same way
    drew the same stream and repeated the opponent's move 55% of the time (a signal the warm start
    learned instead of the rules). With a derived seed it is chance: about 1 in 7."""
    import re

    _, tok = tiny
    specs = [
        EpisodeSpec(
            "connect_four", seed=s, group_id=s, episode_id=s, env_kwargs={"opponent": "random"}
        )
        for s in range(150)
    ]
    digits = [tok.encode(d, add_special_tokens=False)[0] for d in DIGITS]
    demos = play_demonstrations(
        specs,
        "random_legal",
        None,
        tok,
        SamplingConfig(max_new_tokens=1, allowed_token_ids=digits),
        max_turns=21,
        max_context_tokens=4096,
    )
    same = total = 0
    for ep in demos:
        for user, reply in zip(ep.messages[::2], ep.messages[1::2]):
            played = re.search(r"Opponent played (\d)", user["content"])
            if played:
                total += 1
                same += played.group(1) == reply["content"]
    assert total > 800 and 0.08 < same / total < 0.2


def test_every_built_in_policy_builds_and_answers_its_task():
    from earl_lightning.envs.policies import DEMONSTRATION_POLICIES

    board = make_env("connect_four").reset(0)
    question = make_env("calculator").reset(0)
    for name in DEMONSTRATION_POLICIES.names():
        policy = make_policy(name, None, 7)
        answer = policy(question if "calculator" in name else board)
        assert isinstance(answer, str) and answer


def test_the_baselines_script_plays_as_the_direct_env_loop_does():
    """scripts/baselines.py plays through the rollout loop; its figures equal a plain env loop's."""
    from earl_lightning.envs import evaluate_policy
    from tests.load import load_repo_file

    baselines = load_repo_file("scripts/baselines.py", "baselines")
    kwargs = {"opponent": "random", "seat": "alternate"}
    via_rollout = baselines.play("connect_four", kwargs, "centre_first", {}, range(20))
    direct = evaluate_policy(
        make_env("connect_four", **kwargs), make_policy("centre_first", None, 0), range(20)
    )
    assert {k: via_rollout[k] for k in ("win", "draw", "loss", "invalid")} == {
        k: direct[k] for k in ("win", "draw", "loss", "invalid")
    }
    calc = baselines.play(
        "calculator",
        {"difficulty": "easy"},
        "imperfect_calculator",
        {"no_tool_share": 0.0},
        range(10),
    )
    assert calc["correct"] == calc["tool_used"] == 1.0

"""The environment libraries' adapters: a gymnasium env's 5-tuple and an OpenEnv env's models
become the Env contract (seeded, text in and out, info through), and an environment the adapters
cannot play is one line naming `--data.env`."""

from __future__ import annotations

import pytest

from earl_lightning.envs import make_env
from earl_lightning.envs.adapters import GymnasiumEnv, OpenEnvEnv
from earl_lightning.rollout.env_calls import EnvCalls
from earl_lightning.rollout.types import EpisodeSpec

EXAMPLES = "earl_lightning.envs.library_examples"
ARG = "--data.env"


def test_a_gymnasium_env_plays_as_an_env():
    env = make_env(f"{EXAMPLES}.GuessDigit", ARG, max_guesses=2)
    assert isinstance(env, GymnasiumEnv)
    first = env.reset(7)
    assert first == "Guess a digit from 0 to 9 in 2 tries."
    target = env.env._target
    assert make_env(f"{EXAMPLES}.GuessDigit", ARG).reset(7) and env.env._target == target, "seeded"
    wrong = str((target + 1) % 10)
    step = env.step(wrong)
    assert not step.done and step.reward == 0.0 and step.info == {"truncated": False}
    step = env.step(wrong)
    assert step.done and step.info["truncated"] and step.info["outcome"] == "loss"
    env.reset(7)
    assert env.step(str(target)).reward == 1.0
    env.reset(7)
    assert env.step("seven").info["invalid_action"], "the env's own verdict passes through"


def test_an_openenv_env_plays_as_an_env():
    env = make_env(f"{EXAMPLES}.SayLetter", ARG, letters="ab")
    assert isinstance(env, OpenEnvEnv) and env.action_field == "text"
    prompt = env.reset(3)
    letter = prompt.removeprefix("Say the letter ").removesuffix(".")
    assert make_env(f"{EXAMPLES}.SayLetter", ARG, letters="ab").reset(3) == prompt, "seeded"
    step = env.step(letter)
    assert (step.observation, step.reward, step.done, step.info) == (
        "Right.",
        1.0,
        True,
        {"outcome": "win"},
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("PixelEnv", "is a gymnasium environment whose observation_space is Box"),
        (
            "TwoFieldEnv",
            "its action MoveAction has required fields ['x', 'y']; the adapter fills one string field",
        ),
    ],
)
def test_an_environment_the_adapters_cannot_play_is_one_line(env, message):
    with pytest.raises(
        ValueError, match=r"`--data\.env` 'tests\.plugins\.library_envs\." + env + "'"
    ) as err:
        make_env(f"tests.plugins.library_envs.{env}", ARG)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_non_text_observation_fails_its_episode_naming_the_call():
    calls = EnvCalls(None, workers=1, log_faults=False)
    try:
        (started,) = calls.start_all(
            [EpisodeSpec("tests.plugins.library_envs.UndeclaredNumbers", 0, 0, 0)]
        )
    finally:
        calls.close()
    assert "reset() returned an observation of type int; text environments return a str" in str(
        started
    )

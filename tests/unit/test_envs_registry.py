"""Environments by registered name or by import path, and the errors a bad one gives."""

import ast
from pathlib import Path

import pytest

import earl_lightning
from earl_lightning.envs import Env, RecallEnv, check_env_name, env_names, make_env
from tests.plugins.envs import GuessGame

GUESS = "tests.plugins.envs.GuessGame"


def play_binary_search(env: GuessGame, seed: int):
    """Play ``env`` to the end by bisecting on its higher/lower hints; the list of steps."""
    obs = env.reset(seed)
    low, high = env.low, env.high
    steps = []
    while not steps or not steps[-1].done:
        guess = (low + high) // 2
        steps.append(env.step(f"My guess is {guess}"))
        if steps[-1].observation.startswith("Higher"):
            low = guess + 1
        elif steps[-1].observation.startswith("Lower"):
            high = guess - 1
    assert obs.startswith(f"I picked a number between {env.low} and {env.high}")
    return steps


def test_user_env_by_import_path_is_built_with_kwargs_and_played_to_the_end():
    env = make_env(GUESS, "--data.env", high=10)
    assert isinstance(env, GuessGame) and isinstance(env, Env)
    assert (env.low, env.high, env.max_guesses) == (1, 10, 7)
    steps = play_binary_search(env, seed=3)
    assert steps[-1].reward == 1.0 and steps[-1].info == {"invalid_action": False, "outcome": "win"}
    assert all(s.reward == 0.0 and not s.done for s in steps[:-1])
    assert 1 <= len(steps) <= 4  # bisecting 10 numbers takes at most 4 guesses


def test_user_env_loss_and_invalid_action():
    env = make_env(GUESS, "--data.env", high=10, max_guesses=1)
    env.reset(0)
    wrong = 1 if env.secret != 1 else 2
    last = env.step(str(wrong))
    assert last.done and last.reward == 0.0 and last.info["outcome"] == "loss"
    env.reset(0)
    bad = env.step("no idea")
    assert bad.done and bad.reward == -1.0 and bad.info == {"invalid_action": True}


def test_factory_function_by_import_path():
    env = make_env("tests.plugins.envs.small_guess_game", "--data.env", max_guesses=2)
    assert isinstance(env, GuessGame) and (env.high, env.max_guesses) == (10, 2)


def test_user_env_bad_kwargs_come_from_its_constructor():
    with pytest.raises(ValueError, match=r"`low` must be < `high`, got low=1, high=1"):
        make_env(GUESS, "--data.env", high=1)


def test_registered_names_still_work_and_paths_to_them_give_the_registered_entry():
    assert {"calculator", "connect_four", "openspiel", "recall", "textarena"} <= set(env_names())
    assert make_env("recall", num_turns=3).reset(1) == RecallEnv(num_turns=3).reset(1)
    assert isinstance(make_env("earl_lightning.envs.recall.RecallEnv", "--data.env"), RecallEnv)
    assert make_env("connect_four", seat=0).reset(0).startswith("You are x.")


def test_check_env_name_accepts_names_and_import_paths():
    check_env_name("connect_four", "--data.env")
    check_env_name(GUESS, "--data.env")
    check_env_name("tests.plugins.envs.small_guess_game", "--data.env")


@pytest.mark.parametrize(
    "name, match",
    [
        (
            "guess_game",
            r"unknown `--data.env` 'guess_game'; valid environments: \[.*'calculator', 'connect_four', "
            r".*'recall', 'textarena'.*\], or an import path",
        ),
        (
            "no_such_pkg.envs.Game",
            r"`--data.env` 'no_such_pkg.envs.Game': cannot import module 'no_such_pkg.envs': "
            r"ModuleNotFoundError: No module named 'no_such_pkg'",
        ),
        (
            "tests.plugins.envs.GuesGame",
            r"`--data.env` 'tests.plugins.envs.GuesGame': module 'tests.plugins.envs' "
            r"has no attribute 'GuesGame'",
        ),
        (
            "tests.plugins.envs.NOT_CALLABLE",
            r"`--data.env` 'tests.plugins.envs.NOT_CALLABLE' is 42 \(type int\), "
            r"which is not callable; an environment import path must name an Env "
            r"class or a function that returns an Env",
        ),
        (
            "tests.plugins.broken_envs.Game",
            r"`--data.env` 'tests.plugins.broken_envs.Game': cannot import module "
            r"'tests.plugins.broken_envs': RuntimeError: plugin is broken on purpose",
        ),
    ],
)
def test_bad_names_and_paths_fail_at_config_time(name, match):
    with pytest.raises(ValueError, match=match):
        check_env_name(name, "--data.env")
    with pytest.raises(ValueError, match=match):
        make_env(name, "--data.env")


def test_object_that_is_not_an_env():
    # callable: only building it can tell
    check_env_name("tests.plugins.envs.NotAnEnv", "--data.env")
    with pytest.raises(
        ValueError,
        match=r"`--data.env` 'tests.plugins.envs.NotAnEnv' built a NotAnEnv, which does "
        r"not implement the Env protocol \(reset\(seed\) -> str, step\(action\) "
        r"-> StepResult\)",
    ):
        make_env("tests.plugins.envs.NotAnEnv", "--data.env")


def test_base_imports_only_the_project_registry():
    """`envs/base.py` sits below the env modules that register into it (no import cycle): its
    project imports are `earl_lightning.core.registry`, which imports nothing from the project, the
    step result's type and (when an env is built) the library adapters, which import only that
    type."""
    root = Path(earl_lightning.__file__).parent

    def project_imports(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
        return {n for n in names if n.startswith(("earl_lightning", "."))}

    assert project_imports(root / "envs" / "base.py") == {
        "earl_lightning.core.registry",
        "earl_lightning.envs.types",
        "earl_lightning.envs.adapters",
    }
    assert project_imports(root / "core" / "registry.py") == set()
    assert project_imports(root / "envs" / "types.py") == set()
    assert project_imports(root / "envs" / "adapters.py") == {"earl_lightning.envs.types"}

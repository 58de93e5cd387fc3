"""The TextArena adapter: TicTacToe rules through TextArena, invalid moves, seats, determinism,
the random opponent on every game that offers it, and the optional-dependency behaviour."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

pytest.importorskip("textarena")

from earl_lightning.envs import RANDOM_OPPONENT_GAMES, TextArenaEnv, make_env  # noqa: E402
from earl_lightning.envs.textarena_env import random_opponent  # noqa: E402


def play(env: TextArenaEnv, seed: int, policy) -> tuple[list[str], list]:
    observations, results = [env.reset(seed)], []
    while not results or not results[-1].done:
        results.append(env.step(policy(observations[-1])))
        observations.append(results[-1].observation)
    return observations, results


def random_agent(game: str, seed: int = 99):
    """The agent side of a random game: the same move parser, its own generator."""
    return random_opponent(game, seed)


def scripted(moves: list[str]):
    it = iter(moves)
    return lambda observation: next(it)


def first_seed(env, seeds, make_policy, accept):
    for seed in seeds:
        obs, res = play(env, seed, make_policy())
        if accept(res):
            return seed, obs, res
    raise AssertionError("no seed produced the scripted situation")


def test_first_observation_agent_first_and_opponent_first():
    env = TextArenaEnv()
    first = env.reset(0)
    assert first.startswith("You are Player 0 in Tic Tac Toe.")
    assert first.endswith(
        "Available Moves: '[0]', '[1]', '[2]', '[3]', '[4]', '[5]', '[6]', '[7]', '[8]'"
    )
    second = env.reset(1)
    assert second.startswith("You are Player 1 in Tic Tac Toe.")
    assert "[Player 0] [" in second and second.count("Current Board:") == 1  # only the latest board
    assert second.splitlines()[-1].count("'[") == 8


def test_agent_win_on_the_top_row():
    env = TextArenaEnv()
    moves = ["[0]", "[1]", "[2]"]
    _, obs, res = first_seed(
        env,
        range(0, 40, 2),
        lambda: scripted(moves),
        lambda r: len(r) == 3 and r[-1].info.get("outcome") == "win",
    )
    assert [r.reward for r in res] == [0.0, 0.0, 1.0]
    assert res[-1].info == {"invalid_action": False, "outcome": "win"}
    assert obs[-1].endswith("Player 0 has won!")


def test_loss_and_draw_map_to_rewards():
    env = TextArenaEnv()
    _, _, lost = first_seed(
        env,
        range(40),
        lambda: random_agent("TicTacToe-v0"),
        lambda r: r[-1].info.get("outcome") == "loss" and not r[-1].info["invalid_action"],
    )
    assert lost[-1].reward == -1.0 and lost[-1].done
    _, obs, drawn = first_seed(
        env,
        range(60),
        lambda: random_agent("TicTacToe-v0"),
        lambda r: r[-1].info.get("outcome") == "draw",
    )
    assert drawn[-1].reward == 0.0 and "draw" in obs[-1]


@pytest.mark.parametrize("text", ["[4]", "I pick the centre", "[9]"])
def test_invalid_move_ends_with_penalty(text):
    env = TextArenaEnv(invalid_reward=-3.0, seat=0)
    env.reset(0)
    if text == "[4]":
        assert not env.step("[4]").done  # now the cell is taken
    res = env.step(text)
    assert res.done and res.reward == -3.0
    assert res.info == {"invalid_action": True, "outcome": "loss"}


def test_seat_alternates_and_can_be_fixed():
    for seed in range(4):
        assert TextArenaEnv().reset(seed).startswith(f"You are Player {seed % 2} ")
    assert TextArenaEnv(seat=1).reset(0).startswith("You are Player 1 ")


def test_deterministic_and_leaves_global_random_alone():
    random.seed(123)
    expected = [random.random() for _ in range(3)]
    random.seed(123)
    first = play(TextArenaEnv(game="Nim-v0"), 5, random_agent("Nim-v0"))[0]
    assert [random.random() for _ in range(3)] == expected
    env = TextArenaEnv(game="Nim-v0")
    play(env, 8, random_agent("Nim-v0"))
    assert play(env, 5, random_agent("Nim-v0"))[0] == first


@pytest.mark.parametrize("game", sorted(RANDOM_OPPONENT_GAMES))
def test_random_opponent_only_plays_legal_moves(game):
    env = TextArenaEnv(game=game)
    outcomes = set()
    for seed in range(6):
        _, res = play(env, seed, random_agent(game, seed))
        assert not res[-1].info["invalid_action"], res[-1].observation
        assert res[-1].reward == {"win": 1.0, "draw": 0.0, "loss": -1.0}[res[-1].info["outcome"]]
        outcomes.add(res[-1].info["outcome"])
    assert outcomes & {"win", "loss"}


def test_callable_opponent_sees_its_observation():
    seen = []

    def lowest_cell(observation: str) -> str:
        seen.append(observation)
        return observation.rsplit("Available Moves: ", 1)[1].split(",")[0].strip("'")

    env = TextArenaEnv(opponent=lowest_cell, seat=1)
    obs = env.reset(0)
    assert seen[0].startswith("You are Player 0 in Tic Tac Toe.")
    assert "[Player 0] [0]" in obs
    obs = env.step("[4]").observation
    assert "[Player 1] [4]" in seen[1] and "[Player 0] [1]" in obs
    res = env.step("[8]")  # the opponent completes the top row 0-1-2
    assert (
        "[Player 0] [2]" in res.observation and res.info["outcome"] == "loss" and res.reward == -1.0
    )


def test_max_turns_truncates():
    env = TextArenaEnv(game="Nim-v0-large", max_turns=2, seat=0)
    env.reset(0)
    assert not env.step("[0 1]").done
    res = env.step("[1 1]")
    assert (
        res.done and res.reward == 0.0 and res.info == {"invalid_action": False, "truncated": True}
    )


def test_step_after_done_raises():
    env = TextArenaEnv(seat=0)
    env.reset(0)
    env.step("nonsense")
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("[1]")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"game": "TicTacToe-v9"},
            r"unknown `game` 'TicTacToe-v9'; TextArena games with a random opponent: "
            r"\['ConnectFour-v0'.*'TicTacToe-v0'\]",
        ),
        ({"game": "Othello-v0"}, r"`opponent` 'random' is not available for `game` 'Othello-v0'"),
        (
            {"game": "TowerOfHanoi-v0", "opponent": print},
            r"`game` 'TowerOfHanoi-v0' cannot be played as a two-player",
        ),
        ({"opponent": "mcts"}, r"`opponent` must be 'random' or a callable, got 'mcts'"),
        ({"max_turns": 0}, r"`max_turns` must be a positive integer, got 0"),
        ({"seat": "first"}, r"`seat` must be 'alternate', 0 or 1, got 'first'"),
        ({"invalid_reward": "-1"}, r"`invalid_reward` must be a finite number, got '-1'"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextArenaEnv(**kwargs)


def test_registry():
    assert (
        make_env("textarena", game="ConnectFour-v0")
        .reset(2)
        .startswith("You are Player 0 in Connect Four.")
    )
    with pytest.raises(
        ValueError, match=r"unknown argument\(s\) \['opponent_policy'\] for env 'textarena'"
    ):
        make_env("textarena", opponent_policy="random")


def test_missing_textarena_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # makes `import textarena` fail
    with pytest.raises(ImportError, match=r"pip install 'earl_lightning\[textarena\]'"):
        TextArenaEnv()


def test_package_imports_without_textarena():
    code = (
        "import sys; sys.modules['textarena'] = None; import earl_lightning.envs as e; "
        "print(' '.join(e.env_names())); print(e.make_env('connect_four').reset(0)[:10])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, first = out.stdout.splitlines()
    assert {"calculator", "connect_four", "openspiel", "textarena"} <= set(names.split())
    assert first == "You are x."

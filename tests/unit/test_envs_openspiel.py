"""OpenSpiel games: observation format, rules (win / loss / draw / illegal moves), seats,
determinism, the MCTS opponent, and argument errors."""

from __future__ import annotations

import random
import re

import pyspiel
import pytest

from earl_lightning.envs import (
    OpenSpielEnv,
    check_env_name,
    evaluate_policy,
    make_env,
    preference_policy,
    uniform_policy,
)
from earl_lightning.envs.openspiel_env import _win_or_random, legal_from_observation

EMPTY_C4 = "\n".join(["......."] * 6)


def play(env: OpenSpielEnv, seed: int, policy) -> tuple[list[str], list]:
    """Run one episode; return every observation and every StepResult."""
    observations, results = [env.reset(seed)], []
    while not results or not results[-1].done:
        results.append(env.step(policy(observations[-1])))
        observations.append(results[-1].observation)
    return observations, results


def replay(game: str, observations: list[str], actions: list[int]) -> pyspiel.State:
    """Rebuild the game independently from the agent's moves and the opponent moves the
    observations report, so the env's bookkeeping is checked against OpenSpiel itself."""
    state = pyspiel.load_game(game).new_initial_state()
    for i, obs in enumerate(observations):
        head = obs.splitlines()[0]
        match = re.search(r"Opponent played ([\d ]+)\.", head)
        for move in match.group(1).split() if match else []:
            state.apply_action(int(move))
        if i < len(actions) and not state.is_terminal():
            state.apply_action(actions[i])
    return state


def scripted(moves: list[int]):
    """Plays ``moves`` in order, then the first legal action."""
    it = iter(moves)
    return lambda observation: f"I play {next(it, legal_from_observation(observation)[0])}"


def first_seed(env, seeds, policy_factory, accept):
    """The first seed whose episode satisfies ``accept`` (the random opponent depends on it)."""
    for seed in seeds:
        obs, res = play(env, seed, policy_factory())
        if accept(obs, res):
            return seed, obs, res
    raise AssertionError("no seed produced the scripted situation")


def test_observation_shape_agent_first():
    obs = OpenSpielEnv().reset(0)
    assert obs == f"You are x.\n{EMPTY_C4}\nLegal: 0 1 2 3 4 5 6"


def test_observation_shape_opponent_first():
    obs = OpenSpielEnv().reset(1)
    lines = obs.splitlines()
    col = int(re.fullmatch(r"You are o\. Opponent played (\d)\.", lines[0]).group(1))
    assert lines[1:6] == ["......."] * 5
    assert lines[6] == "." * col + "x" + "." * (6 - col)
    assert lines[7] == "Legal: 0 1 2 3 4 5 6"


def test_seat_alternates_with_seed_parity_and_can_be_fixed():
    env = OpenSpielEnv()
    for seed in range(6):
        assert env.reset(seed).startswith("You are x." if seed % 2 == 0 else "You are o.")
    assert OpenSpielEnv(seat=1).reset(0).startswith("You are o. Opponent played")
    assert OpenSpielEnv(seat=0).reset(1) == f"You are x.\n{EMPTY_C4}\nLegal: 0 1 2 3 4 5 6"


def test_vertical_win():
    env = OpenSpielEnv()
    seed, obs, res = first_seed(
        env,
        range(0, 40, 2),
        lambda: scripted([0, 0, 0, 0]),
        lambda o, r: len(r) == 4 and r[-1].info.get("outcome") == "win",
    )
    assert [r.reward for r in res] == [0.0, 0.0, 0.0, 1.0]
    assert [r.done for r in res] == [False, False, False, True]
    assert res[-1].info == {"invalid_action": False, "outcome": "win"}
    rows = obs[-1].splitlines()[1:7]
    assert [row[0] for row in rows[2:]] == ["x"] * 4
    assert obs[-1].endswith("Result: win.")
    assert replay("connect_four", obs, [0, 0, 0, 0]).returns() == [1.0, -1.0]


def test_horizontal_win():
    env = OpenSpielEnv()
    _, obs, res = first_seed(
        env,
        range(0, 60, 2),
        lambda: scripted([0, 1, 2, 3]),
        lambda o, r: len(r) == 4 and r[-1].info.get("outcome") == "win",
    )
    assert res[-1].reward == 1.0
    assert obs[-1].splitlines()[6].startswith("xxxx")
    assert replay("connect_four", obs, [0, 1, 2, 3]).returns() == [1.0, -1.0]


def test_loss_against_mcts_matches_openspiel_returns():
    env = OpenSpielEnv(opponent="mcts", mcts_simulations=20)

    def first_legal(o):
        return str(legal_from_observation(o)[0])

    obs, res = play(env, 1, first_legal)  # odd seed: the agent is player 1 ("o")
    assert res[-1].info == {"invalid_action": False, "outcome": "loss"}
    assert res[-1].reward == -1.0 and all(r.reward == 0.0 for r in res[:-1])
    actions = [legal_from_observation(o)[0] for o in obs[:-1]]
    state = replay("connect_four", obs, actions)
    assert state.is_terminal() and state.returns() == [1.0, -1.0]
    assert str(state).rstrip("\n") == "\n".join(obs[-1].splitlines()[1:7])


def test_draw_on_tic_tac_toe():
    env = OpenSpielEnv(game="tic_tac_toe")
    _, obs, res = first_seed(
        env, range(40), lambda: uniform_policy(0), lambda o, r: r[-1].info.get("outcome") == "draw"
    )
    assert res[-1].reward == 0.0 and res[-1].done
    board = obs[-1].splitlines()[1:4]
    assert "." not in "".join(board) and obs[-1].endswith("Result: draw.")


@pytest.mark.parametrize("text", ["7", "99", "left", "", "column three"])
def test_out_of_range_or_missing_integer_is_invalid(text):
    env = OpenSpielEnv()
    env.reset(0)
    res = env.step(text)
    assert res.done and res.reward == -1.0
    assert res.info == {"invalid_action": True, "outcome": "loss"}


def test_full_column_is_invalid_and_custom_penalty():
    env = OpenSpielEnv(game="connect_four(rows=2)", invalid_reward=-2.5)
    obs = env.reset(0)
    while True:
        res = env.step("0")
        if res.info["invalid_action"]:
            break
        obs = res.observation
    assert 0 not in legal_from_observation(obs)  # the column was full when the agent chose it
    assert res.reward == -2.5 and res.done


def test_occupied_cell_is_invalid_in_tic_tac_toe():
    env = OpenSpielEnv(game="tic_tac_toe", seat=0)
    env.reset(3)
    res = env.step("4")
    assert not res.done and res.observation.splitlines()[2][1] == "x"
    res = env.step("4")
    assert res.info["invalid_action"] and res.reward == -1.0


def test_first_integer_in_text_is_the_action():
    env = OpenSpielEnv(seat=0)
    env.reset(0)
    res = env.step("Column 5, not 2")
    assert res.observation.splitlines()[6][5] == "x"


def test_episode_is_deterministic_given_seed_and_actions():
    for opponent in ("random", "win_or_random", "mcts"):

        def make(opponent=opponent):
            return OpenSpielEnv(opponent=opponent, mcts_simulations=10)

        for seed in (4, 5):
            a, b = play(make(), seed, preference_policy()), play(make(), seed, preference_policy())
            assert a[0] == b[0] and [r.reward for r in a[1]] == [r.reward for r in b[1]]
        # A reused env object, after another episode, replays the same episode as a fresh one.
        env = make()
        play(env, 9, uniform_policy(1))
        assert play(env, 7, preference_policy())[0] == play(make(), 7, preference_policy())[0]
    # ... while the seed does change the random opponent's play.
    first_moves = {OpenSpielEnv().reset(seed).splitlines()[0] for seed in range(1, 40, 2)}
    assert len(first_moves) > 3


def test_mcts_beats_random_play():
    env = OpenSpielEnv(opponent="mcts", mcts_simulations=25)
    stats = evaluate_policy(env, uniform_policy(0), range(6))
    assert stats["loss"] >= 5 / 6


def test_win_or_random_takes_every_immediate_win_and_otherwise_plays_the_random_move():
    game, walk, wins_taken = pyspiel.load_game("connect_four"), random.Random(1), 0
    for episode in range(40):
        state = game.new_initial_state()
        while not state.is_terminal():
            player, legal = state.current_player(), state.legal_actions()
            winners = [
                a
                for a in legal
                if state.child(a).is_terminal() and state.child(a).returns()[player] > 0
            ]
            mine, plain = random.Random(episode), random.Random(episode)
            random_move = plain.choice(legal)
            assert _win_or_random(mine, state) == (min(winners) if winners else random_move)
            # one draw either way: the stream stays the random opponent's
            assert mine.random() == plain.random()
            wins_taken += bool(winners)
            state.apply_action(walk.choice(legal))
    assert wins_taken >= 20
    # A fixed column order never blocks: the opponent that takes its wins beats it far more often.
    fixed = preference_policy((0, 1, 2, 3, 4, 5, 6))
    plain_stats = evaluate_policy(OpenSpielEnv(opponent="random"), fixed, range(64))
    greedy_stats = evaluate_policy(OpenSpielEnv(opponent="win_or_random"), fixed, range(64))
    assert greedy_stats["win"] < plain_stats["win"] - 0.1 and greedy_stats["invalid"] == 0.0


def test_scripted_baselines_against_random_opponent():
    # Win rates the RL agent should beat (200 seeds, seats alternate); see the report.
    uniform = evaluate_policy(OpenSpielEnv(), uniform_policy(0), range(200))
    centre = evaluate_policy(OpenSpielEnv(), preference_policy(), range(200))
    assert 0.4 < uniform["win"] < 0.65 and uniform["invalid"] == 0.0
    assert centre["win"] > 0.8 and centre["win"] > uniform["win"] + 0.2


def test_step_after_done_raises():
    env = OpenSpielEnv()
    env.reset(0)
    env.step("x")
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("3")


def test_registry_builds_connect_four_and_openspiel():
    assert make_env("connect_four").reset(0) == OpenSpielEnv().reset(0)
    ttt = make_env("openspiel", game="tic_tac_toe", seat=0)
    assert ttt.reset(0) == "You are x.\n...\n...\n...\nLegal: 0 1 2 3 4 5 6 7 8"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"game": "conect_four"},
            r"unknown `game` 'conect_four'; suitable OpenSpiel games: .*'connect_four'",
        ),
        (
            {"game": "kuhn_poker"},
            r"`game` 'kuhn_poker' is not a 2-player, sequential, deterministic.*'tic_tac_toe'",
        ),
        ({"game": "connect_four(rowz=3)"}, r"`game` 'connect_four\(rowz=3\)' could not be loaded"),
        (
            {"opponent": "alphazero"},
            r"`opponent` must be one of \['random', 'win_or_random', 'mcts'\], got 'alphazero'",
        ),
        ({"seat": 2}, r"`seat` must be 'alternate', 0 or 1, got 2"),
        ({"mcts_simulations": 0}, r"`mcts_simulations` must be a positive integer, got 0"),
        ({"mcts_rollouts": 1.5}, r"`mcts_rollouts` must be a positive integer, got 1.5"),
        ({"invalid_reward": float("nan")}, r"`invalid_reward` must be a finite number, got nan"),
        (
            {"legal_format": "aligned"},
            r"`legal_format` must be one of \['slots', 'list'\], got 'aligned'",
        ),
        ({"random_opening": -1}, r"`random_opening` must be an integer >= 0, got -1"),
        ({"random_opening": 2.5}, r"`random_opening` must be an integer >= 0, got 2.5"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OpenSpielEnv(**kwargs)


def test_bad_seed_and_env_name_raise():
    with pytest.raises(ValueError, match=r"`seed` must be an integer >= 0, got -1"):
        OpenSpielEnv().reset(-1)
    with pytest.raises(
        ValueError, match=r"unknown `env` 'connect4'; valid environments: .*'connect_four'"
    ):
        make_env("connect4")
    with pytest.raises(ValueError, match=r"unknown `data.env` 'chess'"):
        check_env_name("chess", arg="data.env")
    with pytest.raises(
        ValueError,
        match=r"unknown argument\(s\) \['game'\] for env 'connect_four'; valid: "
        r"\['invalid_reward', 'legal_format', 'legal_move_reward', 'mcts_rollouts'",
    ):
        make_env("connect_four", game="chess")
    with pytest.raises(
        ValueError,
        match=r"unknown argument\(s\) \['opponnet'\] for env 'openspiel'; valid: "
        r"\['game', 'invalid_reward'",
    ):
        make_env("openspiel", opponnet="mcts")


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40), st.integers(min_value=0, max_value=10**6))
def test_any_text_is_a_legal_move_or_an_invalid_action(text, seed):
    env = OpenSpielEnv()
    legal = legal_from_observation(env.reset(seed))
    res = env.step(text)
    digits = re.search(r"\d+", text)
    valid = digits is not None and int(digits.group()) in legal
    assert res.info["invalid_action"] is (not valid)
    assert res.done is (not valid) and res.reward == (0.0 if valid else -1.0)


def test_legal_move_reward_shapes_every_legal_move_only():
    from earl_lightning.envs import make_env

    env = make_env("connect_four", legal_move_reward=0.02, seat=0)
    env.reset(0)
    r = env.step("3")
    assert r.reward == pytest.approx(0.02) and not r.done
    bad = env.step("no move")
    assert bad.reward == -1.0 and bad.done and bad.info["invalid_action"]


def test_full_column_keeps_its_slot_in_the_legal_line():
    from earl_lightning.envs import make_env
    from earl_lightning.envs.openspiel_env import legal_from_observation

    env = make_env("connect_four", seat=0)
    env.reset(0)
    for _ in range(3):
        assert env.step("3").observation.splitlines()[-1] == "Legal: 0 1 2 3 4 5 6"
    # with seed 0 the random opponent also stacked column 3: it is full
    obs = env.step("3").observation
    assert obs.splitlines()[1][3] != "."
    assert obs.splitlines()[-1] == "Legal: 0 1 2 # 4 5 6"
    assert legal_from_observation(obs) == [0, 1, 2, 4, 5, 6]
    last = env.step("3")
    assert last.done and last.info["invalid_action"]


def test_list_format_names_only_the_legal_moves():
    env = make_env("connect_four", seat=0, legal_format="list")
    env.reset(0)
    for _ in range(3):
        env.step("3")
    obs = env.step("3").observation  # seed 0: column 3 is full now (see the test above)
    assert obs.splitlines()[-1] == "Legal: 0 1 2 4 5 6"
    assert legal_from_observation(obs) == [0, 1, 2, 4, 5, 6]


def test_random_opening_starts_mid_game_deterministically_and_never_ended():
    env = OpenSpielEnv(random_opening=10)
    starts = [env.reset(seed) for seed in range(60)]
    assert starts == [OpenSpielEnv(random_opening=10).reset(seed) for seed in range(60)]
    pieces = [
        sum(row.count("x") + row.count("o") for row in obs.splitlines()[1:7]) for obs in starts
    ]
    assert max(pieces) >= 9 and min(pieces) <= 1  # 0..10 random plies (+ the opponent's reply)
    for seed, obs in enumerate(starts):
        # the agent is still the seat the seed gives and it is its turn in an unfinished game
        assert obs.startswith(f"You are {'xo'[seed % 2]}.") and obs.splitlines()[-1].startswith(
            "Legal:"
        )
        assert env.reset(seed) == obs
        assert not env._state.is_terminal() and env._state.current_player() == seed % 2
    assert OpenSpielEnv(random_opening=0).reset(4) == OpenSpielEnv().reset(4)


def test_random_opening_never_hands_the_agent_a_game_the_opponent_already_won():
    # Seed 167 with 12 opening plies used to end in a position where the opponent's reply won
    # (bottom row "xxxx"), so reset() returned a finished game with "Legal: # # # # # # #".
    env = OpenSpielEnv(random_opening=12)
    for seed in range(400):
        obs = env.reset(seed)
        assert not env._state.is_terminal(), seed
        assert legal_from_observation(obs), (seed, obs)

"""scripts/probe_orders.py (the Connect Four strategy figures of docs/experiments/warm_start.md):
its board reading agrees with OpenSpiel's own rules, and its policies take wins and block threats
as their docstrings say."""

from __future__ import annotations

import random

import pyspiel

from earl_lightning.envs.base import make_env
from earl_lightning.envs.openspiel_env import evaluate_policy
from tests.load import load_repo_file

probe = load_repo_file("scripts/probe_orders.py", "probe_orders")


def _observation(board: list[str], me: str = "x") -> str:
    return f"You are {me}.\n" + "\n".join(board) + "\nLegal: 0 1 2 3 4 5 6"


def test_winning_columns_match_openspiel_over_random_games():
    game, rng, checked = pyspiel.load_game("connect_four"), random.Random(0), 0
    for _ in range(60):
        state = game.new_initial_state()
        while not state.is_terminal():
            board, _, _ = probe.read_board(_observation(str(state).rstrip("\n").splitlines()))
            mark = "xo"[state.current_player()]
            expected = [a for a in state.legal_actions()
                        if state.child(a).is_terminal() and state.child(a).returns()[state.current_player()] > 0]
            assert probe.winning_columns(board, mark) == expected, str(state)
            checked += 1
            state.apply_action(rng.choice(state.legal_actions()))
    assert checked > 600


def test_policies_take_a_win_and_block_a_threat():
    threat = [".......", ".......", ".......", ".......", "oo.....", "xxx...."]  # x wins at 3
    block = [".......", ".......", ".......", ".......", "x......", "ooo.x.."]   # o threatens 3
    order = (6, 5, 4, 3, 2, 1, 0)
    assert probe.scripted(order, "order")(_observation(threat)) == "6"
    assert probe.scripted(order, "win_first")(_observation(threat)) == "3"
    assert probe.scripted(order, "win_first")(_observation(block)) == "6"
    assert probe.scripted(order, "safe")(_observation(block)) == "3"


def test_safe_centre_first_beats_the_random_opponent_on_held_out_seeds():
    env = make_env("connect_four", opponent="random", seat="alternate")
    shares = evaluate_policy(env, probe.scripted(probe.CENTRE_FIRST, "safe"), range(32))
    assert shares["invalid"] == 0.0 and shares["win"] >= 0.9
    assert probe.orders(5, 0)[0] == probe.CENTRE_FIRST and len(set(probe.orders(5, 0))) == 5

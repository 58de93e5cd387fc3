"""Two-player OpenSpiel board games (connect_four, tic_tac_toe, ...) against a fixed opponent.

The observation is deliberately compact, because a character-level model reads it every turn::

    You are x. Opponent played 3.
    .......
    ...o...
    Legal: 0 1 2 3 4 5 6

(the board is exactly OpenSpiel's ``str(state)``). The action is the first integer in the model's
text. Also here: two scripted baseline policies and ``evaluate_policy``, which give the win rates
an RL agent should beat.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.envs.base import Env, StepResult, register_env
from earl_lightning.envs.parsing import Seat, agent_player, build_env, check_seat, first_int

# Marks as OpenSpiel prints them for player 0 / player 1; other games say "player 0".
_MARKS = {"connect_four": ("x", "o"), "tic_tac_toe": ("x", "o")}
_UCT_C = 2.0  # OpenSpiel's own examples use this exploration constant for MCTSBot.
# Registered with a game type that qualifies, but it is a loader for a game file, not a game.
_NOT_STANDALONE = frozenset({"efg_game"})
OPPONENTS = ("random", "win_or_random", "mcts")


@functools.lru_cache(maxsize=1)
def suitable_games() -> tuple[str, ...]:
    """Registered OpenSpiel games this env can play: 2 players, sequential, deterministic,
    perfect information, reward only at the end (read from the game types, nothing loaded)."""
    T = pyspiel.GameType
    return tuple(
        sorted(
            t.short_name
            for t in pyspiel.registered_games()
            if t.short_name not in _NOT_STANDALONE
            and t.min_num_players <= 2 <= t.max_num_players
            and t.dynamics == T.Dynamics.SEQUENTIAL
            and t.chance_mode == T.ChanceMode.DETERMINISTIC
            and t.information == T.Information.PERFECT_INFORMATION
            and t.reward_model == T.RewardModel.TERMINAL
        )
    )


def load_two_player_game(game: str, arg: str = "game") -> pyspiel.Game:
    """Load ``game`` (a name, or ``name(param=value,...)``) and check that it is playable here."""
    if not isinstance(game, str):
        raise ValueError(f"`{arg}` must be an OpenSpiel game name, got {game!r}")
    short = game.split("(", 1)[0].strip()
    if short not in pyspiel.registered_names():
        raise ValueError(
            f"unknown `{arg}` {game!r}; suitable OpenSpiel games: {list(suitable_games())}"
        )
    try:
        loaded = pyspiel.load_game(game)
    except pyspiel.SpielError as err:
        raise ValueError(f"`{arg}` {game!r} could not be loaded by OpenSpiel: {err}") from err
    t = loaded.get_type()
    T = pyspiel.GameType
    if (
        loaded.num_players() != 2
        or t.dynamics != T.Dynamics.SEQUENTIAL
        or t.chance_mode != T.ChanceMode.DETERMINISTIC
        or t.information != T.Information.PERFECT_INFORMATION
        or t.reward_model != T.RewardModel.TERMINAL
    ):
        raise ValueError(
            f"`{arg}` {game!r} is not a 2-player, sequential, deterministic, perfect-information "
            f"game with terminal rewards; suitable OpenSpiel games: {list(suitable_games())}"
        )
    return loaded


def _outcome(returns: Sequence[float], agent: int) -> tuple[str, float]:
    """Outcome and reward (+1 / 0 / -1) from the agent's seat, by comparing the two returns."""
    mine, theirs = returns[agent], returns[1 - agent]
    if mine > theirs:
        return "win", 1.0
    if mine < theirs:
        return "loss", -1.0
    return "draw", 0.0


class OpenSpielEnv:
    """A two-player OpenSpiel game; the agent plays one seat, a fixed opponent the other.

    Args:
        game: OpenSpiel game name (optionally with parameters, ``"connect_four(rows=5)"``); must
            be 2-player, sequential, deterministic, perfect-information, terminal-reward.
        opponent: ``"random"`` (uniform over legal moves, RNG seeded from the episode seed),
            ``"win_or_random"`` (a move that wins at once when it has one, else the random
            opponent's move: it punishes every threat the agent leaves open) or ``"mcts"``
            (OpenSpiel's ``MCTSBot`` with a random-rollout evaluator).
        mcts_simulations: MCTS simulations per opponent move.
        mcts_rollouts: random rollouts per MCTS leaf evaluation.
        seat: ``"alternate"`` (agent moves first on even seeds, second on odd), or 0 / 1.
        invalid_reward: reward when the agent's text names no legal action (ends the episode).
        legal_move_reward: shaping reward for every legal move (default 0: pure outcome reward).
            A random-weight model almost never completes a game, so without it every episode ends
            in an illegal move with the same -1 and GRPO sees no signal; a small value (0.02 over
            at most 21 moves stays well below a win's +1) rewards learning the move format first.
        legal_format: ``"slots"`` (games with at most 10 actions keep a slot per action on the
            ``Legal:`` line, ``#`` where illegal) or ``"list"`` (only the legal action ids).
        random_opening: up to this many uniformly random plies (their number drawn from the
            seed) before the agent's first turn, never one that ends the game: training on
            mid-game positions. 0 (default) starts from the initial position.
    """

    def __init__(
        self,
        game: str = "connect_four",
        opponent: Literal["random", "win_or_random", "mcts"] = "random",
        mcts_simulations: int = 50,
        mcts_rollouts: int = 1,
        seat: Seat = "alternate",
        invalid_reward: float = -1.0,
        legal_move_reward: float = 0.0,
        legal_format: Literal["slots", "list"] = "slots",
        random_opening: int = 0,
    ) -> None:
        self.game_name = game
        self.game = load_two_player_game(game)
        self.opponent = check_choice("opponent", opponent, OPPONENTS)
        self.mcts_simulations = check_count("mcts_simulations", mcts_simulations)
        self.mcts_rollouts = check_count("mcts_rollouts", mcts_rollouts)
        self.seat = check_seat(seat)
        self.invalid_reward = check_number("invalid_reward", invalid_reward)
        self.legal_move_reward = check_number("legal_move_reward", legal_move_reward)
        self.legal_format = check_choice("legal_format", legal_format, ("slots", "list"))
        self.random_opening = check_count("random_opening", random_opening, 0)
        self._marks = _MARKS.get(self.game.get_type().short_name, ("player 0", "player 1"))
        # Placeholders until reset(); `_done` makes step() refuse to run before it.
        self._state = self.game.new_initial_state()
        self._agent = 0
        self._opponent_move = self._make_opponent(0)
        self._done = True

    # ---- Env protocol --------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        seed = check_count("seed", seed, 0)
        self._state = self.game.new_initial_state()
        self._agent = agent_player(self.seat, seed)
        self._opponent_move = self._make_opponent(seed)
        self._done = False
        self._play_opening(seed)
        return self._observation(self._play_opponent())

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset(seed) first")
        state = self._state
        legal = state.legal_actions()
        chosen = first_int(action)
        if chosen is None or chosen not in legal:
            # An illegal move forfeits the game, so win-rate metrics count it as a loss.
            self._done = True
            return StepResult(
                f"Invalid move. Legal: {_join(legal)}",
                self.invalid_reward,
                True,
                {"invalid_action": True, "outcome": "loss"},
            )
        state.apply_action(chosen)
        played = self._play_opponent()
        if state.is_terminal():
            self._done = True
            outcome, reward = _outcome(state.returns(), self._agent)
            return StepResult(
                self._observation(played, outcome),
                reward + self.legal_move_reward,
                True,
                {"invalid_action": False, "outcome": outcome},
            )
        return StepResult(
            self._observation(played), self.legal_move_reward, False, {"invalid_action": False}
        )

    # ---- internals -----------------------------------------------------------------------
    def _make_opponent(self, seed: int) -> Callable[[pyspiel.State], int]:
        if self.opponent == "win_or_random":
            return functools.partial(_win_or_random, random.Random(seed))
        if self.opponent == "random":
            rng = random.Random(seed)
            return lambda state: rng.choice(state.legal_actions())
        rs = np.random.RandomState(seed)
        evaluator = mcts.RandomRolloutEvaluator(n_rollouts=self.mcts_rollouts, random_state=rs)
        bot = mcts.MCTSBot(self.game, _UCT_C, self.mcts_simulations, evaluator, random_state=rs)
        return bot.step

    def _play_opening(self, seed: int) -> None:
        """Up to ``random_opening`` uniformly random plies (their number drawn from the seed too),
        so the agent also trains on mid-game positions. The opening stops before a ply that ends
        the game or after which the next move could end it: the opponent's reply to the opening
        must not finish the game before the agent has moved."""
        if not self.random_opening:
            return
        rng = random.Random(f"opening-{seed}")
        for _ in range(rng.randint(0, self.random_opening)):
            nxt = self._state.clone()
            nxt.apply_action(rng.choice(nxt.legal_actions()))
            if nxt.is_terminal() or any(nxt.child(a).is_terminal() for a in nxt.legal_actions()):
                break
            self._state = nxt

    def _play_opponent(self) -> list[int]:
        """Let the opponent move until it is the agent's turn (some games grant extra moves)."""
        played: list[int] = []
        while not self._state.is_terminal() and self._state.current_player() != self._agent:
            move = int(self._opponent_move(self._state))
            self._state.apply_action(move)
            played.append(move)
        return played

    def _legal_line(self) -> str:
        legal = self._state.legal_actions()
        n = self.game.num_distinct_actions()
        return _aligned(legal, n) if n <= 10 and self.legal_format == "slots" else _join(legal)

    def _observation(self, played: list[int], outcome: str | None = None) -> str:
        head = f"You are {self._marks[self._agent]}."
        if played:
            head += f" Opponent played {_join(played)}."
        board = str(self._state).rstrip("\n")
        tail = f"Result: {outcome}." if outcome else f"Legal: {self._legal_line()}"
        return f"{head}\n{board}\n{tail}"


def _win_or_random(rng: random.Random, state: pyspiel.State) -> int:
    """A move after which the player to move has won, if one exists (the lowest id), else a
    uniformly random legal move. The random draw is made either way, so the random stream, and
    every later random move, is the ``"random"`` opponent's for the same seed."""
    legal, player = state.legal_actions(), state.current_player()
    move = rng.choice(legal)
    for action in legal:
        child = state.child(action)
        if child.is_terminal() and child.returns()[player] > 0:
            return action
    return move


def _aligned(legal: Sequence[int], num_actions: int) -> str:
    """``0 1 2 # 4 5 6``: every action id in its own slot, ``#`` where it is illegal.

    A character-level model reads a fixed slot at a fixed distance from where it answers, so
    "column 3 is full" is one position to look at rather than an absence to detect in a list;
    ``#`` appears nowhere else in an observation (boards use ``.``), so its mere presence is a
    content feature too.
    """
    keep = set(legal)
    return " ".join(str(a) if a in keep else "#" for a in range(num_actions))


def _join(actions: Sequence[int]) -> str:
    return " ".join(str(a) for a in actions)


@register_env("openspiel")
def _make_openspiel(**kwargs) -> Env:
    return build_env(OpenSpielEnv, "openspiel", kwargs)


@register_env("connect_four")
def _make_connect_four(**kwargs) -> Env:
    return build_env(
        functools.partial(OpenSpielEnv, game="connect_four"),
        "connect_four",
        kwargs,
        fixed=("game",),
    )


# ---- scripted baselines ------------------------------------------------------------------
_LEGAL_LINE = re.compile(r"^Legal:((?: (?:\d+|#))*)\s*$", re.MULTILINE)


def legal_from_observation(observation: str) -> list[int]:
    """The legal action ids listed on the observation's ``Legal:`` line (empty if none)."""
    match = _LEGAL_LINE.search(observation)
    return [int(a) for a in match.group(1).split() if a.isdigit()] if match else []


def uniform_policy(seed: int = 0) -> Callable[[str], str]:
    """A policy that plays a uniformly random legal move (its own RNG, seeded once)."""
    rng = random.Random(seed)
    return lambda observation: str(rng.choice(legal_from_observation(observation)))


def preference_policy(order: Sequence[int] = (3, 2, 4, 1, 5, 0, 6)) -> Callable[[str], str]:
    """A policy that plays the first legal action in ``order`` (default: centre-first columns)."""
    order = list(order)

    def policy(observation: str) -> str:
        legal = set(legal_from_observation(observation))
        return str(next((a for a in order if a in legal), min(legal, default=0)))

    return policy


def evaluate_policy(
    env: Env, policy: Callable[[str], str], seeds: Sequence[int], max_steps: int = 1000
) -> dict[str, float]:
    """Play one episode per seed; return the fractions of ``win``/``draw``/``loss``/``invalid``
    and the ``mean_reward``."""
    counts = {"win": 0, "draw": 0, "loss": 0, "invalid": 0}
    total = 0.0
    for seed in seeds:
        observation = env.reset(seed)
        for _ in range(max_steps):
            result = env.step(policy(observation))
            observation = result.observation
            if result.done:
                break
        else:
            raise RuntimeError(f"episode with seed {seed} did not end within {max_steps} steps")
        total += result.reward
        key = "invalid" if result.info.get("invalid_action") else result.info["outcome"]
        counts[key] += 1
    n = max(len(seeds), 1)
    return {**{k: v / n for k, v in counts.items()}, "mean_reward": total / n}

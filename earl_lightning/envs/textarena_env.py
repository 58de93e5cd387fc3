"""Adapter for two-player TextArena games (TicTacToe-v0, ConnectFour-v0, Nim-v0, ...).

TextArena is an optional extra, imported only when an env is built. The agent sends its text to
TextArena unchanged (so it must use the game's own action format, e.g. ``[4]`` in TicTacToe);
each observation is what TextArena told the agent since its last move, one message per line.
Mapped onto the Env protocol: an invalid move ends the episode at once (TextArena's error
allowance is set to 0) with ``invalid_reward``; the game's +1 / 0 / -1 become the reward and
``info["outcome"]``.

TextArena seeds and draws from the global ``random`` module; every call into it runs with a
private generator state swapped in, so episodes are reproducible and the caller's ``random`` is
left untouched (not thread-safe, like TextArena itself).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

from earl_lightning.core.checks import check_count, check_number
from earl_lightning.envs.base import StepResult, register_env
from earl_lightning.envs.parsing import Seat, agent_player, build_env, check_seat

Policy = Callable[[str], str]
_INSTALL = "pip install 'earl_lightning[textarena]'"


def _import_textarena() -> Any:
    try:
        import textarena
    except ImportError as err:
        raise ImportError(f"TextArenaEnv needs the optional package textarena: {_INSTALL}") from err
    return textarena


# ---- legal moves read from the opponent's observation text, for the "random" opponent ------
def _tictactoe_moves(observation: str) -> list[str]:
    lines = [ln for ln in observation.splitlines() if ln.startswith("Available Moves:")]
    return re.findall(r"\[\d+\]", lines[-1]) if lines else []


def _connect_four_moves(observation: str) -> list[str]:
    # Board block: "Board state:", column numbers, a dashed line, then rows top first.
    blocks = observation.split("Board state:\n")
    if len(blocks) < 2:
        return []
    top_row = blocks[-1].splitlines()[2].split()
    return [f"[col {c}]" for c, cell in enumerate(top_row) if cell == "."]


def _nim_moves(observation: str) -> list[str]:
    blocks = observation.split("Current Pile:\n")
    piles = re.findall(r"pile (\d+): (\d+)", blocks[-1]) if len(blocks) > 1 else []
    return [f"[{p} {q}]" for p, n in piles for q in range(1, int(n) + 1)]


RANDOM_OPPONENT_GAMES: dict[str, Callable[[str], list[str]]] = {
    "TicTacToe-v0": _tictactoe_moves,
    "ConnectFour-v0": _connect_four_moves,
    "ConnectFour-v0-large": _connect_four_moves,
    "Nim-v0": _nim_moves,
    "Nim-v0-medium": _nim_moves,
    "Nim-v0-large": _nim_moves,
}


def random_opponent(game: str, seed: int) -> Policy:
    """A policy that plays a uniformly random legal move of ``game``, read from its observation."""
    parse, rng = RANDOM_OPPONENT_GAMES[game], random.Random(seed)

    def policy(observation: str) -> str:
        moves = parse(observation)
        if not moves:
            raise RuntimeError(f"random opponent found no legal move for {game} in {observation!r}")
        return rng.choice(moves)

    return policy


def render_messages(messages: list[tuple[int, str, Any]], me: int) -> str:
    """The messages one after another, minus what the player already knows.

    The player's own action is in its transcript, and of several boards only the latest one
    matters; dropping the others keeps the context short for a small model.
    """
    boards = [i for i, (_, _, kind) in enumerate(messages) if _kind(kind) == "GAME_BOARD"]
    lines = []
    for i, (from_id, text, _) in enumerate(messages):
        if from_id == me or (boards and i in boards[:-1]):
            continue
        lines.append(text if from_id < 0 else f"[Player {from_id}] {text}")
    return "\n".join(lines)


def _kind(kind: Any) -> str:
    return getattr(kind, "name", str(kind))


class TextArenaEnv:
    """A two-player TextArena game; the agent plays one seat, a fixed opponent the other.

    Args:
        game: a TextArena env id (its unwrapped ``-raw`` version is used).
        opponent: ``"random"`` (only for the ids in ``RANDOM_OPPONENT_GAMES``) or a callable
            mapping the opponent's observation text to its action text.
        invalid_reward: reward when the agent's move is invalid (ends the episode).
        max_turns: agent moves after which an unfinished game ends with reward 0 and
            ``info["truncated"] = True``.
        seat: ``"alternate"`` (agent is Player 0 and moves first on even seeds), or 0 / 1.
    """

    def __init__(
        self,
        game: str = "TicTacToe-v0",
        opponent: Literal["random"] | Policy = "random",
        invalid_reward: float = -1.0,
        max_turns: int = 100,
        seat: Seat = "alternate",
    ) -> None:
        self._ta = _import_textarena()
        registry = self._ta.envs.registration.ENV_REGISTRY
        if not isinstance(game, str) or f"{game}-raw" not in registry:
            raise ValueError(
                f"unknown `game` {game!r}; TextArena games with a random opponent: "
                f"{sorted(RANDOM_OPPONENT_GAMES)} (other two-player TextArena ids "
                "work with a callable `opponent`)"
            )
        if opponent == "random" and game not in RANDOM_OPPONENT_GAMES:
            raise ValueError(
                f"`opponent` 'random' is not available for `game` {game!r}; it is for "
                f"{sorted(RANDOM_OPPONENT_GAMES)}; pass a callable opponent instead"
            )
        if opponent != "random" and not callable(opponent):
            raise ValueError(f"`opponent` must be 'random' or a callable, got {opponent!r}")
        self.game, self.opponent = game, opponent
        self.invalid_reward = check_number("invalid_reward", invalid_reward)
        self.max_turns = check_count("max_turns", max_turns)
        self.seat = check_seat(seat)
        self._random_state = random.Random(0).getstate()
        self._env = self._make_two_player()
        self._agent, self._turns, self._done = 0, 0, True
        self._policy: Policy = lambda observation: ""

    def _make_two_player(self) -> Any:
        try:
            with self._private_random():
                env = self._ta.make(f"{self.game}-raw")
                env.reset(num_players=2, seed=0)
        # TextArena signals a wrong player count with an assert; some of its games do not even
        # import on every Python version (SyntaxError). Either way this id is unusable here.
        except Exception as err:
            raise ValueError(
                f"`game` {self.game!r} cannot be played as a two-player game: {err!r}"
            ) from err
        return env

    @contextlib.contextmanager
    def _private_random(self) -> Iterator[None]:
        outer = random.getstate()
        random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(outer)

    # ---- Env protocol --------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        seed = check_count("seed", seed, 0)
        self._agent = agent_player(self.seat, seed)
        self._policy = (
            random_opponent(self.game, seed) if self.opponent == "random" else self.opponent
        )
        self._random_state = random.Random(seed).getstate()
        with self._private_random():
            self._env.reset(num_players=2, seed=seed)
        self._env.state.error_allowance = 0  # the Env protocol ends the episode on an invalid move
        self._turns, self._done = 0, False
        if self._play_opponent():
            raise RuntimeError(
                f"{self.game}: the opponent ended the game before the agent moved "
                f"({self._env.state.game_info})"
            )
        return self._take_observation(self._agent)

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset(seed) first")
        self._turns += 1
        with self._private_random():
            done, _ = self._env.step(action)
        if done or self._play_opponent():
            return self._finish()
        if self._turns >= self.max_turns:
            self._done = True
            return StepResult(
                self._take_observation(self._agent),
                0.0,
                True,
                {"invalid_action": False, "truncated": True},
            )
        return StepResult(
            self._take_observation(self._agent), 0.0, False, {"invalid_action": False}
        )

    # ---- internals -----------------------------------------------------------------------
    def _take_observation(self, player: int) -> str:
        # TextArena queues messages per player; taking them makes the next observation incremental.
        messages = self._env.state.observations[player]
        self._env.state.observations[player] = []
        return render_messages(messages, player)

    def _play_opponent(self) -> bool:
        """Opponent moves while it is its turn; returns whether the game ended."""
        state = self._env.state
        while not state.done and state.current_player_id != self._agent:
            move = self._policy(self._take_observation(state.current_player_id))
            with self._private_random():
                self._env.step(move)
        return bool(state.done)

    def _finish(self) -> StepResult:
        self._done = True
        rewards, game_info = self._env.close()
        mine = game_info[self._agent]
        text = self._take_observation(self._agent)
        if mine.get("reason"):
            text = f"{text}\n{mine['reason']}" if text else mine["reason"]
        if mine.get("invalid_move"):
            # An invalid move forfeits the game, so win-rate metrics count it as a loss.
            return StepResult(
                text, self.invalid_reward, True, {"invalid_action": True, "outcome": "loss"}
            )
        reward = float(rewards[self._agent])
        outcome = "win" if reward > 0 else "loss" if reward < 0 else "draw"
        return StepResult(text, reward, True, {"invalid_action": False, "outcome": outcome})


@register_env("textarena")
def _make_textarena(**kwargs) -> TextArenaEnv:
    return build_env(TextArenaEnv, "textarena", kwargs)

"""What Connect Four play reaches the criteria against the random opponent: scripted policies that
read only the observation, on the held-out evaluation seeds (greedy evaluation's env settings).

Three families, each over the same column orders (centre-first 3 2 4 1 5 0 6 and ``--orders - 1``
random permutations of the seven columns):

- ``order``: the first legal column of the order (what a policy that has collapsed onto a fixed
  preference plays; ``centre_first`` is one of them);
- ``win_first``: a column that wins at once, else the order;
- ``safe``: a column that wins at once, else the first column of the order after which the
  opponent has no immediate win (it blocks the opponent's threats and does not play under them),
  else the order.

    python scripts/probe_orders.py --out docs/experiments/results/connect4_orders.csv

Prints the min / median / max win rate of each family over the orders and writes one row per
(family, order) with its win / draw / loss / invalid shares.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
from pathlib import Path
from typing import Callable, Sequence

from _rows import report_rows

from earl_lightning.envs.base import make_env
from earl_lightning.envs.openspiel_env import evaluate_policy, legal_from_observation

ROWS, COLS = 6, 7
CENTRE_FIRST = (3, 2, 4, 1, 5, 0, 6)
_MARK = re.compile(r"^You are ([xo])\.", re.MULTILINE)


def read_board(observation: str) -> tuple[list[list[str]], str, str]:
    """The observation's board as rows top to bottom, the agent's mark and the opponent's."""
    mine = _MARK.search(observation)
    if mine is None:
        raise ValueError(f"not a Connect Four observation (no `You are x/o.` line): {observation!r:.120}")
    lines = [ln for ln in observation.splitlines() if len(ln) == COLS and set(ln) <= set(".xo")]
    if len(lines) != ROWS:
        raise ValueError(f"expected a {ROWS}x{COLS} board in the observation, found {len(lines)} rows")
    me = mine.group(1)
    return [list(ln) for ln in lines], me, "o" if me == "x" else "x"


def drop(board: list[list[str]], col: int, mark: str) -> int | None:
    """Put ``mark`` in ``col`` (in place); the row it landed in, or None if the column is full."""
    for row in range(ROWS - 1, -1, -1):
        if board[row][col] == ".":
            board[row][col] = mark
            return row
    return None


def wins(board: list[list[str]], row: int, col: int) -> bool:
    """Whether the piece at (row, col) is part of four in a row."""
    mark = board[row][col]
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        run = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < ROWS and 0 <= c < COLS and board[r][c] == mark:
                run += 1
                r, c = r + sign * dr, c + sign * dc
        if run >= 4:
            return True
    return False


def winning_columns(board: list[list[str]], mark: str) -> list[int]:
    """Columns where ``mark`` would complete four in a row with one move."""
    found = []
    for col in range(COLS):
        trial = [r[:] for r in board]
        row = drop(trial, col, mark)
        if row is not None and wins(trial, row, col):
            found.append(col)
    return found


def scripted(order: Sequence[int], family: str) -> Callable[[str], str]:
    """The policy of ``family`` over the column order ``order``."""
    def policy(observation: str) -> str:
        legal = set(legal_from_observation(observation))
        ranked = [c for c in order if c in legal]
        if family == "order":
            return str(ranked[0])
        board, me, them = read_board(observation)
        mine = winning_columns(board, me)
        if mine:
            return str(min(mine, key=order.index))
        if family == "safe":
            for col in ranked:
                trial = [r[:] for r in board]
                drop(trial, col, me)
                if not winning_columns(trial, them):
                    return str(col)
        return str(ranked[0])

    return policy


def orders(n: int, seed: int) -> list[tuple[int, ...]]:
    """Centre-first, then ``n - 1`` distinct random permutations of the columns."""
    rng, found = random.Random(seed), [CENTRE_FIRST]
    while len(found) < n:
        perm = tuple(rng.sample(range(COLS), COLS))
        if perm not in found:
            found.append(perm)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=61, help="column orders: centre-first and n-1 random ones")
    parser.add_argument("--episodes", type=int, default=128, help="held-out seeds 0..n-1 (the recipes' eval_episodes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random orders")
    parser.add_argument("--out", type=Path, default=None, help="CSV to write")
    args = parser.parse_args()
    env = make_env("connect_four", opponent="random", seat="alternate")
    rows = []
    for family in ("order", "win_first", "safe"):
        for order in orders(args.orders, args.seed):
            shares = evaluate_policy(env, scripted(order, family), range(args.episodes))
            rows.append({"family": family, "order": "".join(map(str, order)),
                         **{k: round(shares[k], 3) for k in ("win", "draw", "loss", "invalid")}})
    if args.out is not None:
        report_rows(rows, args.out)
    for family in ("order", "win_first", "safe"):
        rates = [r["win"] for r in rows if r["family"] == family]
        centre = next(r["win"] for r in rows if r["family"] == family and r["order"] == "3241506")
        print(f"{family:>9}: win min {min(rates):.3f} median {statistics.median(rates):.3f} "
              f"max {max(rates):.3f} over {len(rates)} orders; centre-first {centre:.3f}")


if __name__ == "__main__":
    main()

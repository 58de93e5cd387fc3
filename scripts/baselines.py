"""The scripted baselines beside the RL results: each demonstration policy played on the held-out
evaluation seeds (0..n-1) of a task, with the evaluation's env settings.

    python scripts/baselines.py --out docs/experiments/results/baselines.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _rows import report_rows

from earl_lightning.models import load_tokenizer
from earl_lightning.modules.metrics import episode_counts
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.demonstrations import play_demonstrations
from earl_lightning.rollout.loop import ToolUse
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.tasks.tool_parsers import get_tool_parser

# (task, env, env kwargs of the evaluation, policy, policy kwargs)
BASELINES = [
    (
        "connect_four",
        "connect_four",
        {"opponent": "random", "seat": "alternate"},
        "random_legal",
        {},
    ),
    (
        "connect_four",
        "connect_four",
        {"opponent": "random", "seat": "alternate"},
        "centre_first",
        {},
    ),
    (
        "tic_tac_toe",
        "openspiel",
        {"game": "tic_tac_toe", "opponent": "random", "seat": "alternate"},
        "random_legal",
        {},
    ),
    (
        "tic_tac_toe",
        "openspiel",
        {"game": "tic_tac_toe", "opponent": "random", "seat": "alternate"},
        "centre_first",
        {"order": (4, 0, 2, 6, 8, 1, 3, 5, 7)},
    ),  # the centre, then corners, then edges
    (
        "hex(board_size=3)",
        "openspiel",
        {"game": "hex(board_size=3)", "opponent": "random", "seat": "alternate"},
        "random_legal",
        {},
    ),
    (
        "hex(board_size=3)",
        "openspiel",
        {"game": "hex(board_size=3)", "opponent": "random", "seat": "alternate"},
        "centre_first",
        {"order": (4, 2, 6, 1, 3, 5, 7, 0, 8)},
    ),  # the centre, then the short diagonal's ends
    (
        "calculator",
        "calculator",
        {"difficulty": "easy", "max_tool_calls": 3},
        "imperfect_calculator",
        {"no_tool_share": 0.6},
    ),
    (
        "calculator",
        "calculator",
        {"difficulty": "easy", "max_tool_calls": 3},
        "imperfect_calculator",
        {"no_tool_share": 0.0},
    ),
]


def play(
    env_name: str, env_kwargs: dict, policy: str, policy_kwargs: dict, seeds: range
) -> dict[str, float]:
    """The policy played on ``seeds`` through the rollout loop, as ``earl sft`` plays its
    demonstrations (the policy's seed derived from each episode's); the shares of each result."""
    specs = [
        EpisodeSpec(env_name, seed=s, group_id=s, episode_id=s, env_kwargs=env_kwargs)
        for s in seeds
    ]
    episodes = play_demonstrations(
        specs,
        policy,
        policy_kwargs,
        load_tokenizer("earl-tiny"),
        SamplingConfig(max_new_tokens=128),
        max_turns=64,
        max_context_tokens=1 << 16,
        history_turns=0,
        tools=ToolUse(get_tool_parser("hermes")),
    )
    c = episode_counts(episodes)
    n = c["episodes"]
    return {
        "win": c["wins"] / n,
        "draw": c["draws"] / n,
        "loss": (c["losses"] - c["invalid"]) / n,
        "invalid": c["invalid"] / n,
        "correct": c["correct"] / n,
        "tool_used": c["tool_used"] / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--episodes",
        type=int,
        default=128,
        help="held-out seeds 0..n-1 (the recipes' eval_episodes)",
    )
    parser.add_argument("--out", type=Path, default=None, help="CSV to write")
    args = parser.parse_args()
    rows = []
    for task, env, env_kwargs, policy, policy_kwargs in BASELINES:
        figures = play(env, env_kwargs, policy, policy_kwargs, range(args.episodes))
        name = policy + "".join(f" {k}={v}" for k, v in policy_kwargs.items())
        rows.append({"task": task, "policy": name, **{k: round(v, 3) for k, v in figures.items()}})
    report_rows(rows, args.out)


if __name__ == "__main__":
    main()

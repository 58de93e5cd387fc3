"""The scripted baselines beside the RL results: each demonstration policy played on the held-out
evaluation seeds (0..n-1) of a task, with the evaluation's env settings.

    python scripts/baselines.py --out docs/experiments/results/baselines.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from earl_lightning.envs import make_env
from earl_lightning.envs.policies import make_policy
from earl_lightning.rollout.demonstrations import policy_seed

# (task, env, env kwargs of the evaluation, policy, policy kwargs)
BASELINES = [
    ("connect_four", "connect_four", {"opponent": "random", "seat": "alternate"}, "random_legal", {}),
    ("connect_four", "connect_four", {"opponent": "random", "seat": "alternate"}, "centre_first", {}),
    ("tic_tac_toe", "openspiel", {"game": "tic_tac_toe", "opponent": "random", "seat": "alternate"},
     "random_legal", {}),
    ("hex(board_size=3)", "openspiel", {"game": "hex(board_size=3)", "opponent": "random", "seat": "alternate"},
     "random_legal", {}),
    ("calculator", "calculator", {"difficulty": "easy", "max_tool_calls": 3}, "imperfect_calculator",
     {"no_tool_share": 0.6}),
    ("calculator", "calculator", {"difficulty": "easy", "max_tool_calls": 3}, "imperfect_calculator",
     {"no_tool_share": 0.0}),
]


def play(env_name: str, env_kwargs: dict, policy: str, policy_kwargs: dict, seeds: range) -> dict[str, float]:
    env = make_env(env_name, **env_kwargs)
    counts = {"win": 0, "draw": 0, "loss": 0, "invalid": 0, "correct": 0, "tool_used": 0}
    for seed in seeds:
        act, observation = make_policy(policy, policy_kwargs, policy_seed(seed)), env.reset(seed)
        while True:
            result = env.step(act(observation))
            if result.done:
                break
            observation = result.observation
        info = result.info
        counts["invalid"] += bool(info.get("invalid_action"))
        if "outcome" in info and not info.get("invalid_action"):
            counts[info["outcome"]] += 1
        counts["correct"] += info.get("correct") is True
        counts["tool_used"] += (info.get("tool_calls") or 0) > 0
    return {k: v / len(seeds) for k, v in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=128, help="held-out seeds 0..n-1 (the recipes' eval_episodes)")
    parser.add_argument("--out", type=Path, default=None, help="CSV to write")
    args = parser.parse_args()
    rows = []
    for task, env, env_kwargs, policy, policy_kwargs in BASELINES:
        figures = play(env, env_kwargs, policy, policy_kwargs, range(args.episodes))
        name = policy + "".join(f" {k}={v}" for k, v in policy_kwargs.items())
        rows.append({"task": task, "policy": name, **{k: round(v, 3) for k, v in figures.items()}})
        print(", ".join(f"{k}={v}" for k, v in rows[-1].items()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()

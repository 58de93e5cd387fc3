"""How much of its probability a Connect Four model puts on full columns, on held-out positions.

    python scripts/probe_legality.py runs/connect4_sft/model [label=dir ...] --out probe.csv

The positions are those a uniformly random legal player meets against the random opponent, on
episode seeds no warm start trains on (900_000_000 + i), with the rollout's own prompts (the
recipe's rollout settings: history_turns 0, one column digit). For each model: over the positions
with at least one full column, the mean probability of the full columns under the policy (the
softmax over the seven column digits, what the rollout samples from) and the share of positions
whose most likely column is full; the same over all positions for the latter. ``earl-tiny`` (random
weights, torch seed 0) is the reference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _rows import report_rows

from earl_lightning.data.episodes import supervised_rows
from earl_lightning.envs.openspiel_env import legal_from_observation
from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.demonstrations import play_demonstrations
from earl_lightning.rollout.types import EpisodeSpec

SEED_BASE = 900_000_000


def positions(tokenizer, episodes: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, legal columns) of every move a random legal player makes."""
    digits = [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(7)]
    specs = [EpisodeSpec("connect_four", seed=SEED_BASE + i, group_id=i, episode_id=i,
                         env_kwargs={"opponent": "random", "seat": "alternate"}) for i in range(episodes)]
    played = play_demonstrations(specs, "random_legal", None, tokenizer, SamplingConfig(
        max_new_tokens=1, allowed_token_ids=digits), max_turns=21, max_context_tokens=4096, history_turns=0)
    out = []
    for ep, rows in zip(played, supervised_rows(played)):
        users = [m["content"] for m in ep.messages if m["role"] == "user"]
        for row in rows:
            for k, pos in row.heads:
                out.append((row.input_ids[:pos], legal_from_observation(users[k])))
    return out


@torch.no_grad()
def probe(model: str, probes: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    label, _, model_dir = model.rpartition("=")
    torch.manual_seed(0)
    model, tok = load_model(model_dir).eval(), load_tokenizer(model_dir)
    digits = torch.tensor([tok.encode(str(d), add_special_tokens=False)[0] for d in range(7)])
    mass, argmax_full, argmax_any, blocked = 0.0, 0, 0, 0
    for prompt, legal in probes:
        p = model(input_ids=torch.tensor([prompt])).logits[0, -1, digits].softmax(-1)
        full = [c for c in range(7) if c not in legal]
        bad = int(p.argmax()) in full
        argmax_any += bad
        if full:
            blocked += 1
            mass += float(p[full].sum())
            argmax_full += bad
    return {"model": label or model_dir, "positions": len(probes), "with_full_column": blocked,
            "full_column_mass": round(mass / max(blocked, 1), 4),
            "argmax_full_share": round(argmax_full / max(blocked, 1), 4),
            "argmax_illegal_all_positions": round(argmax_any / len(probes), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model directories (or earl-tiny), each optionally as label=dir")
    parser.add_argument("--episodes", type=int, default=200, help="held-out random-legal games")
    parser.add_argument("--out", type=Path, default=None, help="CSV to write")
    args = parser.parse_args()
    probes = positions(load_tokenizer(args.models[0].rpartition("=")[2]), args.episodes)
    report_rows([probe(m, probes) for m in ["random weights=earl-tiny", *args.models]], args.out)


if __name__ == "__main__":
    main()

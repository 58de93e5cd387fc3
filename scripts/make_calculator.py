"""Write the calculator task's questions as a dataset, for the agent version of the task
(``earl_lightning.tasks.calculator_agent``, ``recipes/calculator_agent_grpo_warm.yaml``).

    python scripts/make_calculator.py                     # -> data/calculator/{train,test}.jsonl

Each row is the question the ``calculator`` environment asks for one seed (``make_question``):
``prompt`` (the environment's first observation, ``What is 7+12? Answer with the number.``) and
``answer`` (the integer). The test rows are seeds 0..n-1, the environment's own evaluation
seeds, so both versions of the task are evaluated on the same questions; the training rows are
seeds from 1,000,003 on, as the environment's training stream draws them. The same arguments
write the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from earl_lightning.envs.calculator import make_question

ROOT = Path(__file__).resolve().parents[1]
TRAIN_BASE = 1_000_003  # where the environment's training seeds start (datamodule._SEED_STRIDE)


def rows(seeds: range, difficulty: str) -> list[dict]:
    out = []
    for seed in seeds:
        question, answer = make_question(seed, difficulty)
        out.append({"prompt": f"What is {question}? Answer with the number.", "answer": answer})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "data" / "calculator"))
    parser.add_argument("--train", type=int, default=4096)
    parser.add_argument("--test", type=int, default=128)
    parser.add_argument("--difficulty", default="easy", choices=("easy", "medium", "hard"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = {
        "train": rows(range(TRAIN_BASE, TRAIN_BASE + args.train), args.difficulty),
        "test": rows(range(args.test), args.difficulty),
    }
    for name, data in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
    print(f"wrote {args.train} train and {args.test} test rows to {out}")


if __name__ == "__main__":
    main()

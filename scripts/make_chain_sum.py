"""Write the chain-sum arithmetic dataset (reasoning-gym's ``chain_sum`` generator) in TRL's forms.

    python scripts/make_chain_sum.py                       # -> data/chain_sum/{train,test}.jsonl

Each row: ``prompt`` (conversational: one user message, reasoning-gym's question), ``completion``
(the assistant's answer, ``\\boxed{<answer>}``: the SFT target), ``solution`` (the answer, what
``trl.rewards.accuracy_reward`` verifies with math-verify). The test rows are drawn from another
seed and never share a question with the training rows. The same arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rows(size: int, seed: int, terms: int, digits: int) -> list[dict]:
    import reasoning_gym

    data = reasoning_gym.create_dataset("chain_sum", size=size, seed=seed, min_terms=terms, max_terms=terms,
                                        min_digits=digits, max_digits=digits)
    out = []
    for entry in data:
        answer = str(entry["answer"])
        out.append({"prompt": [{"role": "user", "content": entry["question"]}],
                    "completion": [{"role": "assistant", "content": f"\\boxed{{{answer}}}"}],
                    "solution": answer})
    return out


def build(train: int, test: int, terms: int, digits: int, seed: int) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}``: test questions unique and never in train."""
    held, seen = [], set()
    for row in rows(3 * test, seed + 1, terms, digits):
        q = row["prompt"][0]["content"]
        if q not in seen and len(held) < test:
            seen.add(q)
            held.append(row)
    kept = [row for row in rows(train + 3 * test, seed, terms, digits) if row["prompt"][0]["content"] not in seen]
    return {"train": kept[:train], "test": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "data" / "chain_sum"))
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--terms", type=int, default=3)
    p.add_argument("--digits", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, data in build(a.train, a.test, a.terms, a.digits, a.seed).items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"wrote {len(data)} rows to {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()

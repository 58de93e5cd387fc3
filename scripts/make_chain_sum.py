"""Write the chain-sum arithmetic dataset (reasoning-gym's ``chain_sum`` generator) in TRL's forms.

    python scripts/make_chain_sum.py                       # -> data/chain_sum/{train,test}.jsonl

Each row: ``prompt`` (conversational: one user message, reasoning-gym's question), ``completion``
(the SFT target), ``solution`` (the answer, what ``trl.rewards.accuracy_reward`` verifies with
math-verify). A completion either shows the work, one partial sum per operation, then the boxed
answer (``4-1=3, 3-7=-4. \\boxed{-4}``), or states the answer alone (``\\boxed{-4}``): a share
``--worked-share`` of the training rows (drawn from the seed) show the work, as a dataset mixed
from a source with rationales and one without. The test rows are drawn from another seed and never
share a question with the training rows. The same arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worked(expression: str) -> str:
    """The partial sums of ``a op b op c ...``, left to right: ``a op b=s1, s1 op c=s2``."""
    words = expression.split()
    total, steps = int(words[0]), []
    for op, term in zip(words[1::2], words[2::2]):
        after = total + int(term) if op == "+" else total - int(term)
        steps.append(f"{total}{op}{term}={after}")
        total = after
    return ", ".join(steps)


def rows(size: int, seed: int, terms: int, digits: int, worked_share: float) -> list[dict]:
    import reasoning_gym

    data = reasoning_gym.create_dataset("chain_sum", size=size, seed=seed, min_terms=terms, max_terms=terms,
                                        min_digits=digits, max_digits=digits)
    pick = random.Random(seed)
    out = []
    for entry in data:
        answer = str(entry["answer"])
        boxed = f"\\boxed{{{answer}}}"
        text = f"{worked(entry['metadata']['expression'])}. {boxed}" if pick.random() < worked_share else boxed
        out.append({"prompt": [{"role": "user", "content": entry["question"]}],
                    "completion": [{"role": "assistant", "content": text}], "solution": answer})
    return out


def build(train: int, test: int, terms: int, digits: int, seed: int, worked_share: float) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}``: test questions unique and never in train (test
    completions always show the work)."""
    held, seen = [], set()
    for row in rows(3 * test, seed + 1, terms, digits, 1.0):
        q = row["prompt"][0]["content"]
        if q not in seen and len(held) < test:
            seen.add(q)
            held.append(row)
    kept = [row for row in rows(train + 3 * test, seed, terms, digits, worked_share)
            if row["prompt"][0]["content"] not in seen]
    return {"train": kept[:train], "test": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "data" / "chain_sum"))
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--terms", type=int, default=3)
    p.add_argument("--digits", type=int, default=1)
    p.add_argument("--worked-share", type=float, default=0.3, help="share of training rows that show the work")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, data in build(a.train, a.test, a.terms, a.digits, a.seed, a.worked_share).items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"wrote {len(data)} rows to {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()

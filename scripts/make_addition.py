"""Write the addition dataset (reasoning-gym's ``basic_arithmetic``: two 2-digit numbers, ``+``) in
TRL's forms.

    python scripts/make_addition.py                       # -> data/addition/{train,test}.jsonl

Each row: ``prompt`` (conversational: one user message, reasoning-gym's question, ``Calculate 48 +
37.``), ``completion`` (the SFT target), ``solution`` (reasoning-gym's answer, what
``trl.rewards.accuracy_reward`` verifies with math-verify, which reads a ``\\boxed{...}`` answer).
The training rows are mixed from three sources (each row's drawn from the seed): a share
``--worked-share`` works the sum in columns, units first with the carry, and boxes the answer
(``8+7=15, 4+3+1=8. \\boxed{85}``); a share ``--boxed-share`` boxes the answer alone
(``\\boxed{85}``); the rest give the bare number (``85``), which the verifier does not read. The test
rows come from another seed and never share a question with the training rows. The same arguments
write the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def columns(a: int, b: int) -> str:
    """``a + b`` worked in columns, units first: each column's digits, the carry, their sum; the
    last column's sum is the answer's leading digits (``8+7=15, 4+3+1=8``)."""
    steps, carry = [], 0
    while True:
        da, db, a, b = a % 10, b % 10, a // 10, b // 10
        total = da + db + carry
        steps.append(f"{da}+{db}{f'+{carry}' if carry else ''}={total}")
        carry = total // 10 if (a or b) else 0
        if not (a or b):
            return ", ".join(steps)


def rows(size: int, seed: int, worked_share: float, boxed_share: float, digits: int) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise SystemExit(
            "make_addition.py needs reasoning-gym: pip install -e '.[tasks]'"
        ) from None

    data = reasoning_gym.create_dataset(
        "basic_arithmetic",
        size=size,
        seed=seed,
        min_terms=2,
        max_terms=2,
        min_digits=digits,
        max_digits=digits,
        operators=("+",),
        allow_parentheses=False,
        allow_negation=False,
    )
    pick = random.Random(seed)
    out = []
    for entry in data:
        answer = str(entry["answer"])
        a, b = (int(x) for x in entry["metadata"]["expression"].split(" + "))
        draw = pick.random()
        if draw < worked_share:
            text = f"{columns(a, b)}. \\boxed{{{answer}}}"
        else:
            text = f"\\boxed{{{answer}}}" if draw < worked_share + boxed_share else answer
        out.append(
            {
                "prompt": [{"role": "user", "content": entry["question"]}],
                "completion": [{"role": "assistant", "content": text}],
                "solution": answer,
            }
        )
    return out


def build(
    train: int, test: int, seed: int, worked_share: float, boxed_share: float, digits: int
) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}``: test questions unique and never in train (test
    completions worked)."""
    held, seen = [], set()
    for row in rows(3 * test, seed + 1, 1.0, 0.0, digits):
        q = row["prompt"][0]["content"]
        if q not in seen and len(held) < test:
            seen.add(q)
            held.append(row)
    kept = [
        row
        for row in rows(train + 3 * test, seed, worked_share, boxed_share, digits)
        if row["prompt"][0]["content"] not in seen
    ]
    return {"train": kept[:train], "test": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "data" / "addition"))
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--test", type=int, default=500)
    p.add_argument(
        "--worked-share", type=float, default=0.3, help="share of training rows worked and boxed"
    )
    p.add_argument(
        "--boxed-share", type=float, default=0.2, help="share of training rows boxed alone"
    )
    p.add_argument("--digits", type=int, default=2, help="digits of each number")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, data in build(
        a.train, a.test, a.seed, a.worked_share, a.boxed_share, a.digits
    ).items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"wrote {len(data)} rows to {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()

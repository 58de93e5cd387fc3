"""The multi-turn train stage with and without the scored last layer (``optim.scored_last_layer``,
``earl_lightning/train/scored.py``), side by side in one process.

It builds the multi-turn comparison's train batch (64 DigitTurns episodes of 10 turns of 8 tokens,
the whole chat through earl-tiny's template, the replies marked as actions) and times the train
stage's own forward (``forward_micro_batch``) and backward of a loss over the action tokens, the
plain forward and the scored one alternating, ``--repeats`` times each, medians. Before timing it
checks that the two give the same log-probs and gradients. The machine's 2048³ matmul speed and
the 1-minute load are recorded with them.

    python benchmarks/train_scored.py                                    # 5 repeats, 2 threads
    python benchmarks/train_scored.py --repeats 2 --batch 4 --out /tmp/s.csv   # a smoke run

Writes ``benchmarks/results/train_scored.csv`` (``what,value,unit``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_roofline import write_rows
from benchmarks.vs_trl_env import DigitTurns


def episode_with_actions(tokenizer, turns: int, reply_len: int) -> tuple[list[int], list[float]]:
    """One DigitTurns episode's whole chat (every reply ``reply_len`` digits) and its action mask
    (1 on the reply tokens the policy generated, as the rollout marks them)."""
    env = DigitTurns(completion_len=reply_len, turns=turns)
    messages, starts = [{"role": "user", "content": env.reset(0)}], []
    for _ in range(turns):
        starts.append(
            len(
                tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
        )
        reply = "7" * reply_len
        messages.append({"role": "assistant", "content": reply})
        result = env.step(reply)
        if result.done:
            break
        messages.append({"role": "user", "content": result.observation})
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    mask = [0.0] * len(ids)
    for s in starts:
        mask[s : s + reply_len] = [1.0] * reply_len
    return ids, mask


def train_pass(model, mb, scored: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The train stage's forward over ``mb``, a token-mean loss over its actions, the backward;
    returns the log-probs and the gradients."""
    from earl_lightning.train.forward import forward_micro_batch

    res = forward_micro_batch(model, mb, temperature=1.0, with_entropy=True, scored=scored)
    mask = mb.tokens["action_mask"]
    (-(res["logprobs"] * mask).sum() / mask.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return res["logprobs"].detach(), grads


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply-len", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_scored.csv")
    return p.parse_args()


def check_equal(model, mb) -> float:
    """The largest gradient difference between the two passes, relative to the gradient's scale
    (raises when the log-probs of the actions differ)."""
    lp_a, g_a = train_pass(model, mb, False)
    lp_b, g_b = train_pass(model, mb, True)
    on = mb.tokens["action_mask"] > 0
    torch.testing.assert_close(lp_a[on], lp_b[on], atol=1e-5, rtol=1e-5)
    return max(
        float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)) for a, b in zip(g_a, g_b)
    )


def measure(model, mb, repeats: int) -> dict[str, list[float]]:
    """Alternating repeats of the plain and the scored pass (which goes first alternates too)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out: dict[str, list[float]] = {
        "plain": [],
        "scored": [],
        "peak": [],
        "load": [os.getloadavg()[0]],
    }
    for r in range(repeats):
        start = time.perf_counter()
        for _ in range(3):
            a @ b
        out["peak"].append(3 * 2 * 2048**3 / (time.perf_counter() - start))
        for side in ("plain", "scored") if r % 2 == 0 else ("scored", "plain"):
            start = time.perf_counter()
            train_pass(model, mb, side == "scored")
            out[side].append(time.perf_counter() - start)
    out["load"].append(os.getloadavg()[0])
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from earl_lightning.batches.experience import ExperienceBatch
    from earl_lightning.core.host_memory import apply_host_memory
    from earl_lightning.models.loading import resolve_model_path
    from earl_lightning.train.scored import scored_positions

    apply_host_memory()  # as the RL module sets it up
    path = resolve_model_path("earl-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids, mask = episode_with_actions(tokenizer, args.turns, args.reply_len)
    n = args.batch
    mb = ExperienceBatch.from_sequences(
        {"input_ids": [torch.tensor(ids)] * n, "action_mask": [torch.tensor(mask)] * n},
        {
            "rewards": torch.zeros(n),
            "group_ids": torch.arange(n) // 8,
            "episode_ids": torch.arange(n),
        },
    )
    grad_diff = check_equal(model, mb)
    train_pass(model, mb, False)  # warm-up
    times = measure(model, mb, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items() if k != "load"}
    rows = [
        ("episode_tokens", len(ids), "tokens"),
        ("episodes", n, "episodes"),
        ("scored_positions", scored_positions(mb.padded("action_mask")).width, "per episode"),
        ("plain_seconds", med["plain"], "s"),
        ("scored_seconds", med["scored"], "s"),
        ("speedup", med["plain"] / med["scored"], "x"),
        ("max_relative_grad_difference", grad_diff, "ratio"),
        ("peak_2048_gflops", med["peak"] / 1e9, "GFLOP/s"),
        ("load_before", times["load"][0], "1-min load"),
        ("load_after", times["load"][1], "1-min load"),
    ]
    write_rows(rows, args.out)
    print(
        "plain",
        [round(t, 3) for t in times["plain"]],
        "scored",
        [round(t, 3) for t in times["scored"]],
    )


if __name__ == "__main__":
    main()

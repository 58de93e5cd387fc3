"""Causal attention in query chunks (``optim.causal_chunks``, ``earl_lightning/train/causal_chunks.py``)
against one causal call of PyTorch's CPU kernel, side by side in one process.

Two measurements, each side alternating with the other (which goes first alternates too),
``--repeats`` times, medians:

- the attention alone, forward and backward, at earl-tiny's shapes (64 rows, 4 query heads over 2
  KV heads of size 32) for lengths around the range the chunks take (384 to 767): one causal call
  against ``length // 192`` chunks, also where the trainer keeps one call, to show where the
  chunks stop paying;
- the multi-turn train stage's own forward and backward (``forward_micro_batch`` with the scored
  last layer, as the trainer runs it) over the ten-turn comparison's batch (64 DigitTurns episodes
  of 650 tokens, ``benchmarks/train_scored.py``), with the chunks on and off; before timing, the
  two must give the same log-probs (to 1e-5) and it reports the largest gradient difference.

The machine's 2048³ matmul speed and the 1-minute load are recorded with them.

    python benchmarks/causal_chunks.py                                   # 5 repeats, 2 threads
    python benchmarks/causal_chunks.py --repeats 2 --batch 4 --lengths 384 650 --out /tmp/c.csv

Writes ``benchmarks/results/causal_chunks.csv`` (``what,length,chunks,applied,one_call_s,
chunked_s,speedup``).
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from earl_lightning.train import causal_chunks as cc  # noqa: E402

COLUMNS = ["what", "length", "chunks", "applied", "one_call_s", "chunked_s", "speedup"]


def even_bounds(length: int) -> list[int]:
    n = max(1, length // cc.CHUNK_MIN)
    return [round(length * i / n) for i in range(n + 1)]


def attention_pass(q, k, v, grad, bounds: list[int] | None) -> float:
    """Seconds of one forward and backward: one causal call (``bounds`` None) or the chunks."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    if bounds is None:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out = out.transpose(1, 2)
    else:
        out = cc.chunked_causal_attention(*leaves, bounds)
    out.backward(grad)
    return time.perf_counter() - start


def alternate(sides: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each side's callable, the sides alternating and swapping order."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            times[name].append(sides[name]())
    return {name: statistics.median(v) for name, v in times.items()}


def kernel_rows(lengths: list[int], batch: int, repeats: int) -> list[dict]:
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        q = torch.randn(batch, 4, length, 32, generator=g)
        k, v = (torch.randn(batch, 2, length, 32, generator=g) for _ in range(2))
        grad = torch.randn(batch, length, 4, 32, generator=g)
        bounds = even_bounds(length)
        args = (q, k, v, grad)
        sides = {
            "one": functools.partial(attention_pass, *args, None),
            "chunks": functools.partial(attention_pass, *args, bounds),
        }
        med = alternate(sides, repeats)
        rows.append(_row("attention", length, len(bounds) - 1, cc.chunk_bounds(length), med))
    return rows


def _row(what: str, length: int, chunks: int, applied, med: dict[str, float]) -> dict:
    one, ch = med["one"], med["chunks"]
    return dict(
        what=what,
        length=length,
        chunks=chunks,
        applied=applied is not None,
        one_call_s=round(one, 5),
        chunked_s=round(ch, 5),
        speedup=round(one / ch, 3),
    )


def train_row(batch: int, repeats: int) -> tuple[dict, float]:
    """The ten-turn train pass with the chunks on and off; and the largest relative gradient
    difference between the two."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.train_scored import episode_with_actions
    from earl_lightning.batches.experience import ExperienceBatch
    from earl_lightning.models.loading import resolve_model_path
    from earl_lightning.train.forward import forward_micro_batch

    path = resolve_model_path("earl-tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids, mask = episode_with_actions(AutoTokenizer.from_pretrained(path), 10, 8)
    mb = ExperienceBatch.from_sequences(
        {"input_ids": [torch.tensor(ids)] * batch, "action_mask": [torch.tensor(mask)] * batch},
        {"rewards": torch.zeros(batch), "group_ids": torch.arange(batch) // 8},
    )

    def train_pass(chunked: bool):
        res = forward_micro_batch(model, mb, temperature=1.0, scored=True, chunked=chunked)
        m = mb.tokens["action_mask"]
        (-(res["logprobs"] * m).sum() / m.sum()).backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return res["logprobs"].detach(), grads

    (lp_a, g_a), (lp_b, g_b) = train_pass(False), train_pass(True)
    on = mb.tokens["action_mask"] > 0
    torch.testing.assert_close(lp_a[on], lp_b[on], atol=1e-5, rtol=1e-5)
    diff = max(
        float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)) for a, b in zip(g_a, g_b)
    )

    def timed(chunked: bool) -> float:
        start = time.perf_counter()
        train_pass(chunked)
        return time.perf_counter() - start

    med = alternate({"one": lambda: timed(False), "chunks": lambda: timed(True)}, repeats)
    row = _row("train_pass", len(ids), len(cc.chunk_bounds(len(ids)) or [0]) - 1, True, med)
    return row, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 384, 512, 650, 767, 768, 1024])
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "causal_chunks.csv"
    )
    a = p.parse_args()
    if a.repeats < 1 or a.batch < 1 or min(a.lengths) < 2:
        p.error(f"need --repeats >= 1, --batch >= 1, --lengths >= 2; got {vars(a)}")
    torch.set_num_threads(a.threads)
    from earl_lightning.core.host_memory import apply_host_memory

    apply_host_memory()  # as the RL module sets it up
    a_, b_ = torch.randn(2048, 2048), torch.randn(2048, 2048)
    start = time.perf_counter()
    a_ @ b_
    peak = 2 * 2048**3 / (time.perf_counter() - start) / 1e9
    load = [os.getloadavg()[0]]
    rows = kernel_rows(a.lengths, a.batch, a.repeats)
    train, diff = train_row(a.batch, a.repeats)
    rows.append(train)
    load.append(os.getloadavg()[0])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(
        f"{'what':<11}{'length':>7}{'chunks':>7}{'applied':>8}{'one (s)':>10}{'chunks (s)':>11}{'speed-up':>9}"
    )
    for r in rows:
        print(
            f"{r['what']:<11}{r['length']:>7}{r['chunks']:>7}{str(r['applied']):>8}"
            f"{r['one_call_s']:>10.4f}{r['chunked_s']:>11.4f}{r['speedup']:>8.2f}x"
        )
    print(f"train pass: largest relative gradient difference {diff:.2e}")
    print(f"2048^3 matmul {peak:.0f} GFLOP/s; 1-min load {load[0]:.2f} -> {load[1]:.2f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

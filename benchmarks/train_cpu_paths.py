"""The train forward's CPU paths against what they replace, side by side in one process: causal
attention in query chunks (``optim.causal_chunks``, ``earl_lightning/train/causal_chunks.py``),
the RMSNorm's written-out backward (``optim.rms_norm_backward``, ``train/rms_norm.py``) and the
elementwise work compiled (``optim.fused_elementwise``, ``train/fused.py``).

Three measurements, the compared sides alternating (which goes first alternates too),
``--repeats`` times, medians:

- ``attention``: the attention alone, forward and backward, at earl-tiny's shapes (64 rows, 4
  query heads over 2 KV heads of size 32) for lengths around the range the chunks take (384 to
  767): one causal call of PyTorch's CPU kernel against ``length // 192`` chunks, also where the
  trainer keeps one call (``applied`` false), to show where the chunks stop paying;
- ``rms_norm``: one RMSNorm forward and backward over 64 × 650 × 128 activations, autograd's
  backward against the written-out one;
- ``train_pass``: the multi-turn train stage's own forward and backward (``forward_micro_batch``
  with the scored last layer, as the trainer runs it) over the ten-turn comparison's batch (64
  DigitTurns episodes of 650 tokens, ``benchmarks/train_scored.py``) with no path, the first two
  each alone and both, and all three (the defaults; the compiled kernels' one-off compile happens
  before the timing); before timing, every variant must give the same log-probs (to 1e-5), and the
  largest gradient difference is reported.

The machine's 2048³ matmul speed and the 1-minute load are recorded with them.

    python benchmarks/train_cpu_paths.py                                 # 5 repeats, 2 threads (~2 min)
    python benchmarks/train_cpu_paths.py --repeats 2 --batch 4 --lengths 384 650 --out /tmp/c.csv

Writes ``benchmarks/results/train_cpu_paths.csv`` (``what,length,variant,applied,baseline_s,
variant_s,speedup``: the variant against the row's baseline, one call or autograd or no path; the
last row the compiled kernels against the two other paths).
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
from earl_lightning.train import rms_norm as rn  # noqa: E402

COLUMNS = ["what", "length", "variant", "applied", "baseline_s", "variant_s", "speedup"]
TRAIN_VARIANTS = {  # name: (chunked, norm_backward, fused)
    "neither": (False, False, False),
    "chunks": (True, False, False),
    "norm_backward": (False, True, False),
    "both": (True, True, False),
    "fused": (True, True, True),
}


def alternate(sides: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each side's callable, the sides alternating and swapping order."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            times[name].append(sides[name]())
    return {name: statistics.median(v) for name, v in times.items()}


def _row(what: str, length: int, variant: str, applied: bool, base: float, fast: float) -> dict:
    return dict(
        what=what,
        length=length,
        variant=variant,
        applied=applied,
        baseline_s=round(base, 5),
        variant_s=round(fast, 5),
        speedup=round(base / fast, 3),
    )


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


def attention_rows(lengths: list[int], batch: int, repeats: int) -> list[dict]:
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        q = torch.randn(batch, 4, length, 32, generator=g)
        k, v = (torch.randn(batch, 2, length, 32, generator=g) for _ in range(2))
        grad = torch.randn(batch, length, 4, 32, generator=g)
        n = max(1, length // cc.CHUNK_MIN)
        bounds = [round(length * i / n) for i in range(n + 1)]
        args = (q, k, v, grad)
        sides = {
            "one": functools.partial(attention_pass, *args, None),
            "chunks": functools.partial(attention_pass, *args, bounds),
        }
        med = alternate(sides, repeats)
        applied = cc.chunk_bounds(length) is not None
        rows.append(_row("attention", length, f"{n} chunks", applied, med["one"], med["chunks"]))
    return rows


def norm_row(batch: int, repeats: int) -> dict:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(128)
    x, grad = torch.randn(batch, 650, 128), torch.randn(batch, 650, 128)

    def timed(written_out: bool) -> float:
        leaf = x.clone().requires_grad_()
        start = time.perf_counter()
        out = rn.rms_norm(norm, leaf) if written_out else norm(leaf)
        out.backward(grad)
        norm.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    med = alternate({"autograd": lambda: timed(False), "written": lambda: timed(True)}, repeats)
    return _row("rms_norm", 650, "written-out backward", True, med["autograd"], med["written"])


def train_rows(batch: int, repeats: int) -> tuple[list[dict], float]:
    """The ten-turn train pass in :data:`TRAIN_VARIANTS`; and the largest relative gradient
    difference of a variant from the pass with neither path."""
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
    m = mb.tokens["action_mask"]

    def train_pass(variant: str):
        chunked, norms, fused = TRAIN_VARIANTS[variant]
        res = forward_micro_batch(
            model,
            mb,
            temperature=1.0,
            scored=True,
            chunked=chunked,
            norm_backward=norms,
            fused=fused,
        )
        (-(res["logprobs"] * m).sum() / m.sum()).backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return res["logprobs"].detach(), grads

    lp0, g0 = train_pass("neither")
    diff = 0.0
    for variant in list(TRAIN_VARIANTS)[1:]:
        lp, g = train_pass(variant)
        torch.testing.assert_close(lp[m > 0], lp0[m > 0], atol=1e-5, rtol=1e-5)
        scale = [a.abs().max().clamp_min(1e-12) for a in g0]
        diff = max(diff, *(float((a - b).abs().max() / s) for a, b, s in zip(g0, g, scale)))

    def timed(variant: str) -> float:
        start = time.perf_counter()
        train_pass(variant)
        return time.perf_counter() - start

    med = alternate({v: functools.partial(timed, v) for v in TRAIN_VARIANTS}, repeats)
    from earl_lightning.train.fused import MIN_ELEMENTS

    # the compiled kernels take calls of MIN_ELEMENTS values and more (a small --batch: none)
    fused = batch * len(ids) * model.config.hidden_size >= MIN_ELEMENTS
    rows = [
        _row("train_pass", len(ids), v, fused or v != "fused", med["neither"], med[v])
        for v in list(TRAIN_VARIANTS)[1:]
    ]
    rows.append(_row("train_pass", len(ids), "fused over both", fused, med["both"], med["fused"]))
    return rows, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 384, 512, 650, 767, 768, 1024])
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_cpu_paths.csv"
    )
    a = p.parse_args()
    if a.repeats < 1 or a.batch < 1 or min(a.lengths) < 2:
        p.error(f"need --repeats >= 1, --batch >= 1, --lengths >= 2; got {vars(a)}")
    torch.set_num_threads(a.threads)
    from earl_lightning.core.host_memory import apply_host_memory

    apply_host_memory()  # as the RL module sets it up
    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
    start = time.perf_counter()
    x @ y
    peak = 2 * 2048**3 / (time.perf_counter() - start) / 1e9
    load = [os.getloadavg()[0]]
    rows = [*attention_rows(a.lengths, a.batch, a.repeats), norm_row(a.batch, a.repeats)]
    train, diff = train_rows(a.batch, a.repeats)
    rows += train
    load.append(os.getloadavg()[0])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(
        f"{'what':<11}{'length':>7}  {'variant':<22}{'applied':>8}{'base (s)':>10}{'variant (s)':>12}{'speed-up':>9}"
    )
    for r in rows:
        print(
            f"{r['what']:<11}{r['length']:>7}  {r['variant']:<22}{str(r['applied']):>8}"
            f"{r['baseline_s']:>10.4f}{r['variant_s']:>12.4f}{r['speedup']:>8.2f}x"
        )
    print(f"train pass: largest relative gradient difference {diff:.2e}")
    print(f"2048^3 matmul {peak:.0f} GFLOP/s; 1-min load {load[0]:.2f} -> {load[1]:.2f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

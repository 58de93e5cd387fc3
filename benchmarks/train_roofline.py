"""How close the multi-turn train stage of ``benchmarks/vs_trl.py`` runs to this machine's matmul
speed, and what that leaves for a 3× multi-turn target.

The multi-turn comparison's train stage is one forward and backward of earl-tiny over 64 DigitTurns
episodes (10 turns of 8 tokens, whole chat, 650 tokens each) in one micro-batch, the same
computation TRL's training step does. This script builds exactly that batch (the chat template
rendered by earl-tiny's tokenizer), counts its floating-point operations (``FlopCounterMode`` for
the matmuls, causal attention counted by hand since the CPU attention kernel is not in its table),
and times it, interleaved with two matmul probes of the machine: a square 2048³ product (the
machine's dense peak) and the model's own MLP shape (64 · L × 128 @ 128 × 384, what this model can
attain). From the FLOPs, the peak and TRL's measured seconds per multi-turn step (read from
``benchmarks/results/vs_trl.csv``) it prints the lower bound on earl's train stage and the rollout
time the 3× target would leave.

    python benchmarks/train_roofline.py --profile --compile   # 5 repeats, 2 threads; micro-batches of 16 and 8
    python benchmarks/train_roofline.py --attention math eager --micro 8 --out benchmarks/results/train_attention.csv
    python benchmarks/train_roofline.py --repeats 3 --out benchmarks/results/train_roofline.csv

Writes ``benchmarks/results/train_roofline.csv`` (``what,value,unit``).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import multi_turn_seconds
from benchmarks.vs_trl_env import DigitTurns


def episode_ids(tokenizer, turns: int, reply_len: int) -> list[int]:
    """One DigitTurns episode as the trainers train on it: the whole chat, every reply ``reply_len``
    digits (what the digit reward pushes both sides to)."""
    env = DigitTurns(completion_len=reply_len, turns=turns)
    messages = [{"role": "user", "content": env.reset(0)}]
    for _ in range(turns):
        reply = "7" * reply_len
        messages.append({"role": "assistant", "content": reply})
        result = env.step(reply)
        if result.done:
            break
        messages.append({"role": "user", "content": result.observation})
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def train_pass(model, ids: torch.Tensor) -> None:
    """Forward and backward with the train stage's own log-probs (``shifted_logprobs``), their mean."""
    from earl_lightning.algorithms.logprobs import shifted_logprobs

    (-shifted_logprobs(model(input_ids=ids).logits, ids).mean()).backward()
    model.zero_grad(set_to_none=True)


def count_flops(model, ids: torch.Tensor) -> tuple[float, float]:
    """(matmul FLOPs counted by FlopCounterMode, causal attention FLOPs counted by hand) of one pass."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        train_pass(model, ids)
    cfg = model.config
    batch, length = ids.shape
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # QK^T and AV over the causal half: 2 matmuls x 2 FLOPs x (L^2 / 2) x head_dim, per head and layer;
    # the backward is twice the forward.
    attn_fwd = (
        2
        * 2
        * (length * length / 2)
        * head_dim
        * cfg.num_attention_heads
        * cfg.num_hidden_layers
        * batch
    )
    counted = float(counter.get_total_flops())
    by_op = {str(k): v for k, v in counter.get_flop_counts().get("Global", {}).items()}
    attention_counted = sum(v for k, v in by_op.items() if "attention" in k)
    return counted, (0.0 if attention_counted else 3 * attn_fwd)


def timed(fn, repeats: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply-len", type=int, default=8)
    p.add_argument(
        "--micro",
        type=int,
        nargs="*",
        default=[16, 8],
        help="also time the batch in micro-batches of this many episodes (gradient accumulation)",
    )
    p.add_argument(
        "--profile", action="store_true", help="print torch.profiler's top operators of one pass"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time the model under torch.compile (dynamic shapes), whole batch and micro-batched",
    )
    p.add_argument(
        "--attention",
        nargs="*",
        default=[],
        choices=["math", "eager"],
        help="also time the whole batch and micro-batches of 8 with another attention kernel: "
        "SDPA's math path, or HF's eager attention (matmuls and a softmax)",
    )
    p.add_argument("--trl-csv", type=Path, default=ROOT / "benchmarks" / "results" / "vs_trl.csv")
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_roofline.csv"
    )
    return p.parse_args()


def _variants(model, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, tuple]:
    """name -> (model, episodes per micro-batch, context factory) of every pass to time."""
    from contextlib import nullcontext

    none = nullcontext
    variants = {
        "train_seconds": (model, len(ids), none),
        **{f"train_seconds_micro_{m}_episodes": (model, m, none) for m in args.micro},
    }
    if args.compile:
        compiled = torch.compile(model, dynamic=True)
        start = time.perf_counter()
        for m in (len(ids), *args.micro):
            train_pass(compiled, ids[:m])
        print(f"torch.compile and first passes: {time.perf_counter() - start:.1f} s")
        variants.update(
            {
                "train_seconds_compiled": (compiled, len(ids), none),
                **{
                    f"train_seconds_compiled_micro_{m}_episodes": (compiled, m, none)
                    for m in args.micro
                },
            }
        )
    for kernel in args.attention:
        net, ctx = model, none
        if kernel == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = lambda: sdpa_kernel(SDPBackend.MATH)  # noqa: E731
        else:  # the same weights under HF's eager attention
            from transformers import AutoModelForCausalLM

            net = AutoModelForCausalLM.from_config(
                model.config, attn_implementation="eager"
            ).train()
            net.load_state_dict(model.state_dict())
        variants.update(
            {
                f"train_seconds_attention_{kernel}": (net, len(ids), ctx),
                f"train_seconds_attention_{kernel}_micro_8_episodes": (net, 8, ctx),
            }
        )
    return variants


def measure(model, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, list[float]]:
    """Interleaved repeats of: the two matmul probes (FLOP/s), the whole-batch pass and every
    variant (micro-batched, compiled, another attention kernel) in seconds; plus the 1-minute load
    before and after."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    x = torch.randn(ids.numel(), model.config.hidden_size)
    w = torch.randn(model.config.hidden_size, model.config.intermediate_size)
    variants = _variants(model, ids, args)
    train_pass(model, ids)  # warm-up
    out: dict[str, list[float]] = {
        "peak": [],
        "shaped": [],
        **{name: [] for name in variants},
        "load": [os.getloadavg()[0]],
    }

    def run(net, m, ctx):
        with ctx():
            for i in range(0, len(ids), m):
                train_pass(net, ids[i : i + m])

    for _ in range(args.repeats):
        out["peak"].append(2 * 2048**3 / timed(lambda: a @ b, 3))
        out["shaped"].append(2 * x.shape[0] * x.shape[1] * w.shape[1] / timed(lambda: x @ w, 3))
        for name, (net, m, ctx) in variants.items():
            out[name].append(timed(lambda net=net, m=m, ctx=ctx: run(net, m, ctx)))
    out["load"].append(os.getloadavg()[0])
    return out


def report_rows(
    ids: torch.Tensor,
    counted: float,
    attention: float,
    times: dict[str, list[float]],
    trl: float | None,
) -> list[tuple[str, float, str]]:
    flops = counted + attention
    med = {k: statistics.median(v) for k, v in times.items() if k != "load"}
    t_train, g_peak = med["train_seconds"], med["peak"]
    rows = [
        ("episode_tokens", ids.shape[1], "tokens"),
        ("batch_tokens", ids.numel(), "tokens"),
        ("matmul_gflop_counted", counted / 1e9, "GFLOP"),
        ("attention_gflop_by_hand", attention / 1e9, "GFLOP"),
        ("train_seconds", t_train, "s"),
        ("train_gflops", flops / t_train / 1e9, "GFLOP/s"),
        ("peak_2048_gflops", g_peak / 1e9, "GFLOP/s"),
        ("model_shape_gflops", med["shaped"] / 1e9, "GFLOP/s"),
        ("train_at_peak_seconds", flops / g_peak, "s"),
        ("train_share_of_peak", flops / t_train / g_peak, "ratio"),
        *((name, value, "s") for name, value in med.items() if name.startswith("train_seconds_")),
        ("load_before", times["load"][0], "1-min load"),
        ("load_after", times["load"][1], "1-min load"),
    ]
    if trl is not None:
        rows += [
            ("trl_multi_seconds_per_step", trl, "s"),
            ("ratio_bound_zero_rollout", trl / (flops / g_peak), "x"),
            ("rollout_budget_for_3x_at_measured_train", trl / 3 - t_train, "s"),
            ("rollout_budget_for_3x_at_peak_train", trl / 3 - flops / g_peak, "s"),
        ]
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from earl_lightning.models.loading import resolve_model_path

    path = resolve_model_path("earl-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    ids = torch.tensor([episode_ids(tokenizer, args.turns, args.reply_len)] * args.batch)
    counted, attention = count_flops(model, ids)
    times = measure(model, ids, args)
    if args.profile:
        _profile(model, ids)
    trl = trl_multi_seconds(args.trl_csv, args.reply_len, args.turns)
    write_rows(report_rows(ids, counted, attention, times, trl), args.out)


def write_rows(rows: list[tuple[str, float, str]], out: Path) -> None:
    """Write ``rows`` as a ``what,value,unit`` CSV at ``out`` and print them aligned."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        csv.writer(f).writerows([("what", "value", "unit"), *rows])
    width = max(len(r[0]) for r in rows)
    for name, value, unit in rows:
        print(f"{name:<{width}}  {value:>10.3f}  {unit}")
    print(f"wrote {out}")


def _profile(model, ids: torch.Tensor, top: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_pass(model, ids)
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60
        )
    )


def trl_multi_seconds(path: Path, reply_len: int, turns: int) -> float | None:
    """TRL's seconds per multi-turn step for ``turns`` turns of ``reply_len`` tokens from a
    ``vs_trl.py`` medians CSV; None without the file or such a row (the report then leaves it out)."""
    return multi_turn_seconds(path, reply_len, turns).get("trl") if path.exists() else None


if __name__ == "__main__":
    main()

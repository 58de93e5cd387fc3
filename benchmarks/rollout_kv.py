"""Multi-turn rollout throughput: KV-cache reuse across turns vs re-prefilling the whole context.

Seven methods: ``kv_reuse`` (the default backend: each call takes the previous call's KV buffer
whole when every request continues one of its rows, a decode step runs the model's modules
without transformers' per-call wrapping and attends with the query heads that share a KV head as
rows of it, by two matrix products on CPU, and a prefill runs the last layer past its keys and
values at the last column only), ``kv_hf_forward`` (the same with every decode step through the
model's forward: ``HFBackend(direct_decode=False)``), ``kv_whole_layer`` (the same with the whole last layer in every
prefill: ``HFBackend(prefill_tail=False)``), ``kv_sdpa_rows`` (the rows through SDPA's kernel:
``HFBackend(decode_matmul=False)``), ``kv_grouped`` (the same with SDPA's ``enable_gqa`` in
decode: ``HFBackend(gqa_decode_rows=False)``), ``kv_repack`` (every episode's cache packed anew on
each call: ``HFBackend(reuse_buffer=False)``) and ``reprefill``.

The process's malloc is set up as the RL module sets it (``EARL_HOST_MEMORY``, default ``retain``:
``earl_lightning/core/host_memory.py``). All methods play the same ``recall`` episodes (observations
padded so the context reaches about two thousand tokens at 20 turns) with the same seed, so they
generate identical tokens; the script checks that. Methods are interleaved per turn count (and their
order alternates per repeat) so that load on a shared machine hits both alike.

    python benchmarks/rollout_kv.py --quick        # < 3 minutes on 2 CPU cores
    python benchmarks/rollout_kv.py                # more episodes, 3 repeats

Writes ``benchmarks/results/rollout_kv.csv`` (turns,method,tokens_per_s,seconds: the median
repeat; then its CPU seconds and the 1-minute load average before and after the point) and
``rollout_kv.png``, and prints a table with the speedups.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch

from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = (
    "kv_reuse",
    "kv_hf_forward",
    "kv_whole_layer",
    "kv_sdpa_rows",
    "kv_grouped",
    "kv_repack",
    "reprefill",
)
BACKEND_KWARGS = {
    "kv_reuse": {},
    "kv_hf_forward": {"direct_decode": False},
    "kv_whole_layer": {"prefill_tail": False},
    "kv_sdpa_rows": {"decode_matmul": False},
    "kv_grouped": {"gqa_decode_rows": False},
    "kv_repack": {"reuse_buffer": False},
    "reprefill": {"reuse_kv": False},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer episodes, one repeat (< 3 min on 2 cores)"
    )
    p.add_argument("--model", default="earl-tiny", help="model preset, hub id or local path")
    p.add_argument(
        "--episodes", type=int, default=None, help="episodes per rollout (default 32, quick 16)"
    )
    p.add_argument("--turns", type=int, nargs="+", default=[5, 10, 20])
    p.add_argument(
        "--padding-chars", type=int, default=16, help="filler characters per recall observation"
    )
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per point (default 3, quick 1)"
    )
    # One thread: the tiny model gains nothing from intra-op threads, and on a shared machine
    # spinning OpenMP workers make wall times noisy.
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "rollout_kv.csv")
    args = p.parse_args(argv)
    args.episodes = args.episodes or (16 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.episodes < 1 or args.repeats < 1 or min(args.turns) < 1:
        p.error(
            f"--episodes, --repeats and --turns must be >= 1, got {args.episodes}, {args.repeats}, {args.turns}"
        )
    return args


def run_once(backend: HFBackend, tokenizer, turns: int, args: argparse.Namespace):
    """One timed rollout; returns (wall seconds, CPU seconds, generated tokens, final context
    lengths, token ids). CPU time is printed too because wall time on a shared machine also
    measures the neighbours."""
    specs = [
        EpisodeSpec(
            "recall",
            seed=1000 + i,
            group_id=i,
            episode_id=i,
            env_kwargs={"num_turns": turns, "padding_chars": args.padding_chars},
        )
        for i in range(args.episodes)
    ]
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, seed=0)
    start, cpu_start = time.perf_counter(), time.process_time()
    episodes = rollout(
        specs, backend, tokenizer, sampling, max_turns=turns, max_context_tokens=1 << 20
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(ep.num_generated for ep in episodes)
    return (
        seconds,
        cpu,
        generated,
        [len(ep.token_ids) for ep in episodes],
        [ep.token_ids for ep in episodes],
    )


def measure(args: argparse.Namespace) -> list[dict]:
    from earl_lightning.core.host_memory import apply_host_memory

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # malloc as the RL module sets it up (EARL_HOST_MEMORY, default retain): with glibc's own
    # settings each large temporary is mapped afresh, and which variant pays more page faults
    # depends on the order of its allocations rather than on its work
    apply_host_memory()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    backends = {m: HFBackend(model, tokenizer, **BACKEND_KWARGS[m]) for m in METHODS}
    run_once(backends["kv_reuse"], tokenizer, 2, args)  # warm-up: allocator, first-call overheads
    rows = []
    for turns in args.turns:
        times, cpus = {m: [] for m in METHODS}, {m: [] for m in METHODS}
        load_before = os.getloadavg()[0]
        for rep in range(args.repeats):
            order = METHODS if rep % 2 == 0 else METHODS[::-1]
            outputs = {}
            for method in order:
                seconds, cpu, generated, lengths, ids = run_once(
                    backends[method], tokenizer, turns, args
                )
                times[method].append(seconds)
                cpus[method].append(cpu)
                outputs[method] = ids
            if any(outputs[m] != outputs["kv_reuse"] for m in METHODS):
                raise RuntimeError(f"the methods generated different tokens at {turns} turns")
        for method in METHODS:
            seconds = statistics.median(times[method])
            rows.append(
                {
                    "turns": turns,
                    "method": method,
                    "tokens_per_s": generated / seconds,
                    "seconds": seconds,
                    "cpu_seconds": statistics.median(cpus[method]),
                    "generated": generated,
                    "context_mean": sum(lengths) / len(lengths),
                    "context_max": max(lengths),
                    "load_before": load_before,
                    "load_after": os.getloadavg()[0],
                }
            )
        print(
            f"  {turns} turns done: "
            + ", ".join(f"{m} {statistics.median(times[m]):.2f}s" for m in METHODS),
            flush=True,
        )
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(
            f,
            fieldnames=[
                "turns",
                "method",
                "tokens_per_s",
                "seconds",
                "cpu_seconds",
                "load_before",
                "load_after",
            ],
        )
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    "turns": r["turns"],
                    "method": r["method"],
                    "tokens_per_s": f"{r['tokens_per_s']:.1f}",
                    "seconds": f"{r['seconds']:.3f}",
                    "cpu_seconds": f"{r['cpu_seconds']:.3f}",
                    "load_before": f"{r['load_before']:.2f}",
                    "load_after": f"{r['load_after']:.2f}",
                }
            )
    by = {(r["turns"], r["method"]): r for r in rows}
    print(
        f"\n{args.episodes} episodes, {args.max_new_tokens} new tokens/turn, recall padding {args.padding_chars}, "
        f"model {args.model}, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'turns':>5} {'context mean/max':>17} {'kv_reuse tok/s':>15} {'reprefill tok/s':>16} {'speedup':>8} "
        f"{'kv/ref CPU s':>14} {'CPU speedup':>12} {'kv_repack tok/s':>16} {'reuse/repack':>13} "
        f"{'grouped/rows':>13} {'whole/tail':>11} {'sdpa/matmul':>12} {'hf/direct':>10}"
    )
    for turns in args.turns:
        kv, ref, rep = by[(turns, "kv_reuse")], by[(turns, "reprefill")], by[(turns, "kv_repack")]
        grouped, whole = by[(turns, "kv_grouped")], by[(turns, "kv_whole_layer")]
        sdpa_rows, hf_forward = by[(turns, "kv_sdpa_rows")], by[(turns, "kv_hf_forward")]
        ctx = f"{kv['context_mean']:.0f}/{kv['context_max']}"
        print(
            f"{turns:>5} {ctx:>17} {kv['tokens_per_s']:>15.1f} {ref['tokens_per_s']:>16.1f} "
            f"{ref['seconds'] / kv['seconds']:>7.2f}x {kv['cpu_seconds']:>6.1f}/{ref['cpu_seconds']:<7.1f} "
            f"{ref['cpu_seconds'] / kv['cpu_seconds']:>11.2f}x {rep['tokens_per_s']:>16.1f} "
            f"{rep['seconds'] / kv['seconds']:>12.3f}x {grouped['seconds'] / kv['seconds']:>12.3f}x "
            f"{whole['seconds'] / kv['seconds']:>10.3f}x {sdpa_rows['seconds'] / kv['seconds']:>11.3f}x "
            f"{hf_forward['seconds'] / kv['seconds']:>9.3f}x"
        )
    loads = [r[k] for r in rows for k in ("load_before", "load_after")]
    print(f"1-minute load average over the points: {min(loads):.2f}-{max(loads):.2f}")
    print(f"wrote {args.out}")
    plot(rows, args)


def plot(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        pts = [r for r in rows if r["method"] == method]
        ax.plot(
            [r["turns"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o", label=method
        )
    for turns in args.turns:
        kv = next(r for r in rows if r["turns"] == turns and r["method"] == "kv_reuse")
        ref = next(r for r in rows if r["turns"] == turns and r["method"] == "reprefill")
        ax.annotate(
            f"{ref['seconds'] / kv['seconds']:.1f}x",
            (turns, kv["tokens_per_s"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
        )
    ax.set_xlabel("turns per episode")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Multi-turn rollout, {args.episodes} episodes ({args.model})")
    ax.legend()
    fig.tight_layout()
    png = args.out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report(measure(args), args)


if __name__ == "__main__":
    main()

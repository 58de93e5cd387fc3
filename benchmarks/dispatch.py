"""Decentralized all-to-all dispatch vs gather-to-rank-0-then-scatter (EARL paper, Sec. dispatcher).

Per-worker payloads in the paper's proportions (46 / 93 / 187 MiB and a tenth of each) on 2 and 4
gloo processes (CPU). Every worker holds an experience batch of that size (packed tokens, action
mask, three float32 per-token fields, per-sequence fields); it is redistributed from a dp-only
layout to a token-balanced dp-only layout as a full reshuffle (``locality=False``: a sequence goes
wherever balance puts it, so (N-1)/N of every worker's bytes move, like the paper's all-to-all of
reference log-probs; ``--locality`` lets balanced data stay put instead), by:

- ``decentralized``: :class:`earl_lightning.dispatch.dispatcher.Dispatcher` (one all_to_all per dtype);
- ``centralized-tensor``: gather of padded buffers on rank 0, then scatter;
- ``centralized-object``: ``gather_object`` / ``scatter_object_list`` of pickled batches.

Measured per (world, payload, method): median latency over ``--runs`` timed runs after
``--warmup`` untimed ones (slowest rank, between barriers); bytes through the busiest rank (sent +
received over the network, from the plan, which a unit test checks against the split sizes);
rank 0's peak memory: the rise of its resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs after ``malloc_trim`` before each method) above its resident set before that
method's first run —
i.e. what the dispatch itself adds on top of the payload. All methods of one world run in one
process group; the three methods free everything between them.

Then a cost model extrapolates bytes through the busiest rank and transfer time to 128 and 1,024
ranks at 25 and 200 Gbps, beside the paper's Table 1 data sizes.

    python benchmarks/dispatch.py --quick      # tenths + 46 MiB, 5 runs (under 3 minutes)
    python benchmarks/dispatch.py              # all six payloads
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.dispatch.centralized import CentralizedDispatcher
from earl_lightning.dispatch.dispatcher import Dispatcher
from earl_lightning.parallel.launch_env import free_port
from earl_lightning.parallel.layout import Layout

PAPER_MIB = (46, 93, 187)
METHODS = ("decentralized", "centralized-tensor", "centralized-object")
TOKEN_BYTES = 8 + 1 + 4 + 4 + 4  # input_ids, action_mask, logprobs, ref_logprobs, advantages
RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20


# ---- payload -------------------------------------------------------------------------------------
def make_payload(rank: int, mib: float, seed: int = 0) -> ExperienceBatch:
    """About ``mib`` MiB of experience on this rank. The mean context grows with the payload
    (46 MiB ~ 8K tokens, 187 MiB ~ 32K, as in the paper); lengths vary +-50% around it. Fields are
    allocated at full size directly, so building the payload leaves no large temporaries behind."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    tokens = int(mib * MIB / TOKEN_BYTES)
    ctx = max(1024, int(8192 * mib / PAPER_MIB[0]))
    n = max(1, round(tokens / ctx))
    lens = (torch.rand(n, generator=g) + 0.5) * ctx
    lens = (lens * tokens / lens.sum()).long().clamp(min=1)
    lens[-1] += tokens - int(lens.sum())
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    fields = {
        "input_ids": torch.randint(0, 151_000, (tokens,), generator=g),
        "action_mask": torch.randint(0, 2, (tokens,), generator=g, dtype=torch.uint8).bool(),
    }
    for name in ("logprobs", "ref_logprobs", "advantages"):
        fields[name] = torch.empty(tokens).normal_(generator=g)
    seqs = {
        "rewards": torch.randn(n, generator=g),
        "group_ids": torch.arange(n) // 8 + 1000 * rank,
        "episode_ids": torch.arange(n) + 1_000_000 * rank,
    }
    return ExperienceBatch(cu, fields, seqs)


def make_dispatcher(method: str, locality: bool):
    if method == "decentralized":
        return Dispatcher(locality=locality)
    return CentralizedDispatcher(method=method.removeprefix("centralized-"), locality=locality)


# ---- memory --------------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Return freed heap memory to the OS (so a previous method's freed buffers cannot hide this
    method's allocations), then reset the resident-set high-water mark to the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


# ---- one process group ---------------------------------------------------------------------------
def time_method(
    method: str, batch: ExperienceBatch, to: Layout, runs: int, warmup: int, locality: bool
) -> dict:
    disp = make_dispatcher(method, locality)
    resettable = reset_peak()
    rss_before = _status_kib("VmRSS")
    times = []
    for i in range(warmup + runs):
        dist.barrier()
        start = time.perf_counter()
        out = disp.exchange(batch, to)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
        del out
        if i >= warmup:
            times.append(float(elapsed))
    peak = (_status_kib("VmHWM") - rss_before) * 1024 if resettable else -1
    return {
        "seconds": statistics.median(times),
        "busiest_rank_bytes": int(disp.last_stats["busiest_rank_bytes"]),
        "rank0_peak_bytes": peak,
        "imbalance": disp.last_stats["imbalance"],
        "all_seconds": times,
    }


def worker(
    rank: int,
    world: int,
    port: int,
    sizes: list[float],
    methods: list[str],
    runs: int,
    warmup: int,
    locality: bool,
    queue,
):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = []
        for mib in sizes:
            batch = make_payload(rank, mib)
            for method in methods:
                res = time_method(method, batch, Layout(dp=world, tp=1), runs, warmup, locality)
                rows.append({"world": world, "mib_per_worker": mib, "method": method, **res})
            del batch
        queue.put((rank, rows))
    except BaseException as e:  # noqa: BLE001 - surface the failure to the parent
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def run_world(
    world: int,
    sizes: list[float],
    methods: list[str],
    runs: int,
    warmup: int,
    locality: bool = False,
) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=worker, args=(r, world, port, sizes, methods, runs, warmup, locality, queue)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join()
    if not isinstance(results[0], list):
        raise RuntimeError(f"benchmark worker failed: {results}")
    return results[0]  # rank 0's view: timings are already the max over ranks


# ---- cost model ----------------------------------------------------------------------------------
PAPER_TABLE1_GB = {
    1024: 15.6,
    32768: 500.0,
}  # data dispatched per iteration on 1,024 GPUs (Table 1)
ALPHA_S = 10e-6  # per-message latency of one point-to-point transfer (RDMA-class network)


def paper_total_gb(context: int) -> float:
    """Table 1's endpoints (15.6 GB at 1K, 500 GB at 32K) grow linearly with context (15.6 x 32 ~ 500);
    the rows in between are that linear interpolation, not figures quoted from the paper."""
    return (
        PAPER_TABLE1_GB[1024] * context / 1024
        if context not in PAPER_TABLE1_GB
        else PAPER_TABLE1_GB[context]
    )


def cost_model(moved_fraction: float | None = None) -> list[dict]:
    """Bytes through the busiest rank and transfer time per dispatch, for N ranks each holding the
    paper's per-GPU share (Table 1 total / 1,024), weak scaling. Centralized: rank 0 receives every
    other rank's share and sends it back out (2 (N-1)/N of the total through one NIC, which is
    full-duplex: time = the larger direction / bandwidth). Decentralized: every rank sends and
    receives ``moved_fraction`` of its own share (default (N-1)/N, what a balanced all-to-all
    moves), plus a per-message latency for its N-1 peers."""
    rows = []
    for ranks in (128, 1024):
        for context in (1024, 2048, 4096, 8192, 16384, 32768):
            share = paper_total_gb(context) * 1e9 / 1024
            frac = (ranks - 1) / ranks if moved_fraction is None else moved_fraction
            per_dir = {"centralized": share * (ranks - 1), "decentralized": share * frac}
            for method, one_way in per_dir.items():
                row = {
                    "ranks": ranks,
                    "context": context,
                    "paper_total_gb_1024": paper_total_gb(context),
                    "total_gb": share * ranks / 1e9,
                    "method": method,
                    "busiest_rank_gb": 2 * one_way / 1e9,
                }
                latency = ALPHA_S * (ranks - 1) * (2 if method == "centralized" else 1)
                for gbps in (25, 200):
                    row[f"seconds_{gbps}gbps"] = one_way * 8 / (gbps * 1e9) + latency
                rows.append(row)
    return rows


# ---- output --------------------------------------------------------------------------------------
def write_results(rows: list[dict], model: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cols = [
        "world",
        "mib_per_worker",
        "method",
        "seconds",
        "busiest_rank_bytes",
        "rank0_peak_bytes",
    ]
    with open(out / "dispatch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(out / "dispatch_cost_model.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(model[0]))
        w.writeheader()
        w.writerows(model)
    plot(rows, out / "dispatch.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    keys = [
        ("seconds", "median latency (s)"),
        ("busiest_rank_bytes", "bytes through busiest rank (MiB)"),
        ("rank0_peak_bytes", "rank-0 peak memory added (MiB)"),
    ]
    for ax, (key, label) in zip(axes, keys):
        for world in sorted({r["world"] for r in rows}):
            for method, style in zip(METHODS, ("o-", "s--", "^:")):
                pts = sorted(
                    (r["mib_per_worker"], r[key])
                    for r in rows
                    if r["world"] == world and r["method"] == method
                )
                if pts:
                    scale = 1 if key == "seconds" else MIB
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] / scale for p in pts],
                        style,
                        label=f"{method}, {world} procs",
                    )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("payload per worker (MiB)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "Dispatch between layouts: decentralized all-to-all vs gather-then-scatter (gloo, CPU)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_tables(rows: list[dict], model: list[dict]) -> None:
    print(
        f"{'world':>5} {'MiB/worker':>10} {'method':>19} {'median s':>9} {'busiest MiB':>12} {'rank0 peak MiB':>15}"
    )
    for r in rows:
        print(
            f"{r['world']:>5} {r['mib_per_worker']:>10.1f} {r['method']:>19} {r['seconds']:>9.3f} "
            f"{r['busiest_rank_bytes'] / MIB:>12.1f} {r['rank0_peak_bytes'] / MIB:>15.1f}"
        )
    for world in sorted({r["world"] for r in rows}):
        top = max(r["mib_per_worker"] for r in rows if r["world"] == world)
        by = {r["method"]: r for r in rows if r["world"] == world and r["mib_per_worker"] == top}
        if {"decentralized", "centralized-tensor"} <= set(by):
            d, c = by["decentralized"], by["centralized-tensor"]
            print(
                f"world {world}, {top} MiB/worker: decentralized vs centralized-tensor: "
                f"{c['seconds'] / d['seconds']:.2f}x faster, "
                f"{c['busiest_rank_bytes'] / max(d['busiest_rank_bytes'], 1):.2f}x fewer busiest-rank bytes, "
                f"{c['rank0_peak_bytes'] / max(d['rank0_peak_bytes'], 1):.2f}x less rank-0 peak memory"
            )
    print(
        f"\n{'ranks':>5} {'context':>7} {'Table1 GB@1024':>14} {'total GB':>9} {'method':>13} "
        f"{'busiest GB':>10} {'s @25Gbps':>10} {'s @200Gbps':>10}"
    )
    for m in model:
        print(
            f"{m['ranks']:>5} {m['context']:>7} {m['paper_total_gb_1024']:>14.1f} {m['total_gb']:>9.1f} "
            f"{m['method']:>13} {m['busiest_rank_gb']:>10.2f} {m['seconds_25gbps']:>10.2f} "
            f"{m['seconds_200gbps']:>10.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tenths of the paper's payloads plus 46 MiB"
    )
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--sizes", type=float, nargs="+", default=None, help="MiB per worker (overrides --quick)"
    )
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--locality",
        action="store_true",
        help="let data stay on its rank (default: a full reshuffle, every byte that can move does)",
    )
    args = ap.parse_args(argv)
    if args.runs < 5:
        ap.error(f"--runs must be >= 5 (median of at least 5 timed runs), got {args.runs}")
    tenths = [m / 10 for m in PAPER_MIB]
    sizes = args.sizes or (tenths + [PAPER_MIB[0]] if args.quick else tenths + list(PAPER_MIB))
    start = time.perf_counter()
    rows = []
    for world in args.worlds:
        rows += run_world(world, sizes, args.methods, args.runs, args.warmup, args.locality)
    model = cost_model()
    write_results(rows, model, args.out)
    print_tables(rows, model)
    print(
        f"\nwrote {args.out / 'dispatch.csv'}, dispatch_cost_model.csv, dispatch.png "
        f"in {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()

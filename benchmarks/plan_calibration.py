"""``earl plan``'s models against this machine: predicted vs measured stage time and peak memory.

The same memory model and time model ``earl plan`` uses, with the ``CPU`` device profile
(``earl_lightning/parallel/devices/CPU.json``: one core, one torch thread per process, gloo over
loopback), predict what the profiler's stage runs (``profiling/profiler.py``: the HF rollout, the
experience forward, the train step) take on 1 and 2 processes, for the layouts
``benchmarks/selector.py`` chooses among: dp1xtp1 (1 process), dp2xtp1 and dp1xtp2 (2
processes), each with 16384- and 1024-token micro-batches, the train stage also with activation
checkpointing; 4 sequences of 512 and 2048 tokens, 8 generated tokens in rollout.

Measured per cell, in a fresh copy of the model: the stage's seconds (the slowest rank's, median
of the timed runs after one warm-up) and its peak memory (the rise of the peak RSS, ``VmHWM``
reset through ``/proc/self/clear_refs``, over the RSS before the model copy was built, with
glibc returning every block of 256 KiB or more to the OS when freed, so that RSS follows live
tensors; the largest rank's). Goal: peak memory within 10%, stage time within 25%.

``--fit`` measures the profile instead: the machine's rates by probes (a 1024^3 fp32 matmul, a
256 MiB copy into another tensor, gloo all-reduces of 4 bytes and 64 MiB between 2 processes),
then the efficiency factors and per-call overheads (a layer's launches, a generation step's, a
collective's as the TP and FSDP code paths issue it) by a least-squares fit of log time on the
same layouts at 256 and 1024 tokens, contexts the evaluation does not use; it writes CPU.json.

    python benchmarks/plan_calibration.py --fit     # the CPU profile (~5 min on a quiet machine)
    python benchmarks/plan_calibration.py           # the error table (~5 min on a quiet machine)
    python benchmarks/plan_calibration.py --quick   # 128 / 256 tokens, 1 run per cell: a smoke run

Writes benchmarks/results/plan_calibration.csv (and plan_calibration_fit.csv with --fit).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import functools
import gc
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from selector import exact_rss_allocator, peak_since_reset, reset_peak, spawn  # noqa: E402

from earl_lightning.callbacks.adaptive_setup import memory_model_of  # noqa: E402
from earl_lightning.modules.config import AlgorithmConfig, OptimConfig, RolloutConfig  # noqa: E402
from earl_lightning.modules.views import workload_view  # noqa: E402
from earl_lightning.parallel.hardware import DEVICES_DIR, Cluster, DeviceProfile, device_profile  # noqa: E402
from earl_lightning.parallel.layout import Layout  # noqa: E402
from earl_lightning.parallel.timing import TimeModel  # noqa: E402
from earl_lightning.planning.plan import full_name  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIB = 2**20
BIG, SMALL = 16384, 1024
NUM_SEQS, GEN_LEN = 4, 8
PRESET = "earl-tiny"
GOALS = {"memory": 0.10, "time": 0.25}
# what the profiler's runs do: one HF call per rollout (no KV kept between calls), the scored
# last layer (a quarter of each synthetic sequence is actions), no reference model
WORKLOAD = workload_view(
    RolloutConfig(reuse_kv=False, sampling={"max_new_tokens": GEN_LEN}),
    AlgorithmConfig(),
    OptimConfig(micro_batch_tokens=BIG, scored_last_layer=True),
    lora=False,
    scored_last_layer=True,
)
FITTED = (
    "matmul_efficiency",
    "attention_efficiency",
    "memory_efficiency",
    "layer_overhead_s",
    "step_overhead_s",
    "intra_node_latency_s",  # a collective as the TP and FSDP code paths issue it (DTensor, hooks)
)


def cells(world: int, contexts: list[int], mbts: list[int]) -> list[tuple[str, Layout, int]]:
    """(stage, layout, context) of one process count; the rollout ignores the micro-batch."""
    places = [(1, 1)] if world == 1 else [(2, 1), (1, 2)]
    out = []
    for ctx in contexts:
        for dp, tp in places:
            out.append(("rollout", Layout(dp, tp, mbts[0]), ctx))
            out += [("experience", Layout(dp, tp, m), ctx) for m in mbts]
            out += [("train", Layout(dp, tp, m, c), ctx) for m in mbts for c in (False, True)]
    return out


def stats_of(context: int) -> dict[str, float]:
    scored = max(1, context // 4)
    return dict(
        num_seqs=NUM_SEQS,
        context_mean=context,
        context_max=context,
        context_p95=context,
        gen_len=GEN_LEN,
        scored_max=scored,
        scored_share_max=scored / context,
    )


# ---- measuring (in the spawned processes) -------------------------------------------------------
def _setup(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        TOKENIZERS_PARALLELISM="false",
        EARL_HOST_MEMORY="glibc",  # the module must not undo exact_rss_allocator
    )
    torch.set_num_threads(1)
    exact_rss_allocator()
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)


def measure_worker(rank, world, port, todo, repeats, queue):
    """Every cell of ``todo`` in a fresh model copy: (seconds, peak bytes) per cell."""
    import warnings

    warnings.filterwarnings("ignore")
    try:
        _setup(rank, world, port)
        from earl_lightning.models import load_model, load_tokenizer
        from earl_lightning.parallel.collectives import Reducer
        from earl_lightning.profiling.profiler import StageProfiler

        base_model, tok = load_model(PRESET), load_tokenizer(PRESET)
        # A stage's first run in a process faults in code pages and builds lazy state (about
        # 17 MiB): warm every stage and placement up once, unmeasured, as a running trainer is.
        warm = StageProfiler(lambda: copy.deepcopy(base_model), tok)
        for stage, layout in dict.fromkeys((st, lay) for st, lay, _ in todo):
            warm.run(stage, layout, 16, NUM_SEQS, 2)
        del warm
        out = []
        for stage, layout, ctx in todo:
            gc.collect()
            base = reset_peak()
            prof = StageProfiler(lambda: copy.deepcopy(base_model), tok)
            prof.run(stage, layout, ctx, NUM_SEQS, GEN_LEN)  # builds the copy; warm-up
            secs = [prof.run(stage, layout, ctx, NUM_SEQS, GEN_LEN)[0] for _ in range(repeats)]
            peak = torch.tensor([float(peak_since_reset() - base)], dtype=torch.float64)
            peak = float(Reducer().max(peak)[0])
            out.append(
                dict(
                    stage=stage,
                    layout=full_name(layout),
                    context=ctx,
                    seconds=statistics.median(secs),
                    peak=peak,
                )
            )
            del prof
            if rank == 0:
                print(
                    f"{world}p {stage:10s} {full_name(layout):22s} ctx={ctx:5d} {out[-1]['seconds']:.3f}s {peak / MIB:.1f} MiB",
                    flush=True,
                )
        queue.put((rank, out))
    except BaseException:  # noqa: BLE001 - surface the failure to the parent
        import traceback

        queue.put((rank, traceback.format_exc()))


def probe_worker(rank, world, port, queue):
    """The rates a profile is built from: matmul FLOP/s and copy bandwidth on one thread; gloo's
    all-reduce latency and bandwidth between the two processes."""
    try:
        _setup(rank, world, port)
        import torch.distributed as dist

        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        mm = _median_time(lambda: a @ b, 7)
        big, dst = torch.ones(64 * MIB), torch.zeros(64 * MIB)  # 256 MiB each
        copy_s = _median_time(lambda: dst.copy_(big), 5)
        small, large = torch.zeros(1), torch.zeros(16 * MIB)  # 4 B, 64 MiB
        lat = _median_time(lambda: dist.all_reduce(small), 50)
        big_s = _median_time(lambda: dist.all_reduce(large), 5)
        out = dict(
            peak_flops=2 * 1024**3 / mm,
            memory_bandwidth=2 * big.numel() * 4 / copy_s,  # read + write
            latency=lat,
            link_bandwidth=large.numel() * 4 / max(big_s - lat, 1e-9),  # 2 ranks: S bytes each way
        )
        queue.put((rank, out))
    except BaseException:  # noqa: BLE001
        import traceback

        queue.put((rank, traceback.format_exc()))


def _median_time(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---- predicting -----------------------------------------------------------------------------------
@functools.cache
def memory_model():
    """The memory model ``earl plan`` builds for the preset and the profiler's workload."""
    from transformers import AutoConfig

    from earl_lightning.models.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(PRESET))
    return memory_model_of(config, "float32", "adamw", WORKLOAD, resident_train_state=False)


def predict(rows: list[dict], profile: DeviceProfile) -> list[dict]:
    memory = memory_model()
    out = []
    for r in rows:
        lay = _parse(r["layout"])
        time_model = TimeModel(memory, Cluster(1, lay.world_size, profile))
        s = stats_of(r["context"])
        secs = time_model.seconds(r["stage"], lay, s, skip=("sync", "dispatch"))
        peak = memory.estimate(r["stage"], lay, s).total
        out.append(
            {
                **{k: r[k] for k in ("stage", "layout", "context")},
                "processes": lay.world_size,
                "measured_s": r["seconds"],
                "predicted_s": secs,
                "time_error": secs / r["seconds"] - 1,
                "measured_mib": r["peak"] / MIB,
                "predicted_mib": peak / MIB,
                "memory_error": peak / r["peak"] - 1,
            }
        )
    return out


def _parse(name: str) -> Layout:
    m = re.fullmatch(r"dp(\d+)xtp(\d+)-mbt(\d+)(-ckpt)?", name)
    return Layout(int(m[1]), int(m[2]), int(m[3]), bool(m[4]))


# ---- fitting the profile ----------------------------------------------------------------------------
def fit_profile(probe: dict, rows: list[dict], load: str) -> DeviceProfile:
    """The CPU profile: the probes' rates, then the efficiencies and overheads that minimize the
    squared log error of the predicted stage times of ``rows``."""
    import numpy as np
    from scipy.optimize import minimize

    start = device_profile("CPU")
    rates = dataclasses.replace(
        start,
        peak_flops={k: probe["peak_flops"] for k in start.peak_flops},
        memory_bandwidth=probe["memory_bandwidth"],
        intra_node_bandwidth=probe["link_bandwidth"],
        inter_node_bandwidth=probe["link_bandwidth"],
        intra_node_latency_s=probe["latency"],
        inter_node_latency_s=probe["latency"],
        link_efficiency=1.0,
        comm_overlap=0.0,
    )

    def with_params(x) -> DeviceProfile:
        v = dict(zip(FITTED, np.exp(x)))
        for k in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
            v[k] = min(1.0, v[k])
        return dataclasses.replace(rates, **v, inter_node_latency_s=v["intra_node_latency_s"])

    def loss(x) -> float:
        return sum(math.log(1 + p["time_error"]) ** 2 for p in predict(rows, with_params(x)))

    x0 = np.log([getattr(rates, k) for k in FITTED])
    best = minimize(
        loss, x0, method="Nelder-Mead", options=dict(maxiter=400, xatol=1e-3, fatol=1e-6)
    )
    fitted = with_params(best.x)
    stamp = time.strftime("%Y-%m-%d")
    how = f"benchmarks/plan_calibration.py --fit, {stamp}, load {load}"
    sources = {
        **fitted.sources,  # what the fit does not touch keeps its source (memory_bytes, ...)
        "peak_flops": f"measured: a 1024^3 fp32 matmul on one thread ({how})",
        "memory_bandwidth": f"measured: copying a 256 MiB tensor into another, read + write, one thread ({how})",
        "intra_node_bandwidth": f"measured: gloo all_reduce of 64 MiB between 2 processes over loopback ({how})",
        "inter_node_bandwidth": "no second machine here: taken equal to the loopback figure",
        "inter_node_latency_s": "taken equal to intra_node_latency_s (no second machine here)",
        "link_efficiency": "1: the bandwidth is the measured one",
        "comm_overlap": "0: gloo's collectives run on the cores that compute",
        **{
            k: f"fitted: least squares of log stage time over {len(rows)} cells on 1 and 2 processes at "
            f"256 and 1024 tokens (plan_calibration_fit.csv; {how}); start: the probes"
            for k in FITTED
        },
    }
    return dataclasses.replace(fitted, sources=sources)


def write_profile(profile: DeviceProfile) -> Path:
    path = DEVICES_DIR / "CPU.json"
    path.write_text(json.dumps(dataclasses.asdict(profile), indent=1) + "\n")
    return path


# ---- report -------------------------------------------------------------------------------------------
def report(pred: list[dict]) -> list[str]:
    lines = [
        f"{'procs':>5} {'stage':10} {'layout':24} {'ctx':>5} {'meas s':>8} {'pred s':>8} {'err':>7} "
        f"{'meas MiB':>9} {'pred MiB':>9} {'err':>7}"
    ]
    for p in pred:
        lines.append(
            f"{p['processes']:>5} {p['stage']:10} {p['layout']:24} {p['context']:>5} "
            f"{p['measured_s']:>8.3f} {p['predicted_s']:>8.3f} {p['time_error']:>+7.1%} "
            f"{p['measured_mib']:>9.1f} {p['predicted_mib']:>9.1f} {p['memory_error']:>+7.1%}"
        )
    for what, key in (("time", "time_error"), ("memory", "memory_error")):
        errs = [abs(p[key]) for p in pred]
        within = sum(e <= GOALS[what] for e in errs)
        lines.append(
            f"{what}: {within}/{len(errs)} cells within {GOALS[what]:.0%}; median |error| "
            f"{statistics.median(errs):.1%}, largest {max(errs):.1%}"
        )
    return lines


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(
            {k: f"{v:.5g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )


def measure(contexts: list[int], mbts: list[int], repeats: int, worlds=(1, 2)) -> list[dict]:
    rows = []
    for world in worlds:
        rows += spawn(measure_worker, world, cells(world, contexts, mbts), repeats)
    return rows


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="128 / 256 tokens, one micro-batch size, 1 run per cell",
    )
    ap.add_argument("--fit", action="store_true", help="measure the CPU profile and write CPU.json")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed runs per cell (default 3; quick 1)"
    )
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    mbts = [BIG] if args.quick else [BIG, SMALL]
    out, t0, load0 = Path(args.out), time.perf_counter(), _load()
    if args.fit:
        probe = spawn(probe_worker, 2)
        print("probes: " + ", ".join(f"{k} {v:.4g}" for k, v in probe.items()))
        rows = measure([64, 128] if args.quick else [256, 1024], mbts, repeats)
        profile = fit_profile(probe, rows, f"{load0}-{_load()}")
        pred = predict(rows, profile)
        write_csv(out / "plan_calibration_fit.csv", pred)
        print("\n".join(report(pred)))
        print("fitted: " + ", ".join(f"{k} {getattr(profile, k):.4g}" for k in FITTED))
        print(f"wrote {write_profile(profile)}")
    else:
        rows = measure([128, 256] if args.quick else [512, 2048], mbts, repeats)
        pred = predict(rows, device_profile("CPU"))
        write_csv(out / "plan_calibration.csv", pred)
        print("\n".join(report(pred)))
    print(f"total {time.perf_counter() - t0:.0f}s, load {load0} at start, {_load()} at the end")


if __name__ == "__main__":
    main()

"""earl_lightning vs TRL 1.16's GRPOTrainer, side by side on the same work.

Same weights (earl-tiny, fp32), prompts, reward (:mod:`benchmarks.vs_trl_env`), batch (64
completions per step in groups of 8), completion length, sampling (temperature 1), KL 0, AdamW at
the same constant learning rate, one optimizer step per batch. Two modes: single-turn (completion
lengths 8 and 32) and multi-turn (an environment of 10 turns with per-turn feedback; earl through
its multi-turn rollout, TRL through ``GRPOTrainer(rollout_func=...)``).

Each run is one side in a fresh process (``benchmarks/vs_trl_sides.py``); the sides alternate
(A B, then B A, ...). A run times a fixed matmul workload before and after training: a run more
than 1.5x slower on it than the fastest run is flagged and left out of the medians (unless every run
is flagged); the share of its cores a run got (CPU time / wall time / threads) is recorded too.
Seconds per step are wall-clock intervals between step ends after ``--warmup`` steps; tokens/s =
generated tokens per step / seconds per step; peak RSS is the process's high-water mark. Each
step is also split: earl's ``stage/rollout/seconds`` and ``stage/train/seconds``; TRL's
generation and scoring (``_generate_and_score_completions``) and the rest of its ``training_step``
(the loss forward and backward), recorded as ``rollout_s`` and ``train_s``.

    python benchmarks/vs_trl.py            # 3 runs per side and mode (~20 min on 2 cores)
    python benchmarks/vs_trl.py --quick    # 1 run, fewer steps (< 5 min)
    python benchmarks/vs_trl.py --modes multi --host-memory   # + earl with malloc untouched, TRL with earl's setting

Writes ``benchmarks/results/vs_trl.csv`` (medians), ``vs_trl_runs.csv`` (every run) and
``vs_trl_ratios.csv`` (per point: the earl/TRL speed ratio of the medians, the lowest and highest
ratio of the run-by-run pairs, the equal-work check (tokens generated per step within 10%) and
whether both rewards rose), and prints them as tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from earl_lightning.core.host_memory import ENV as HOST_MEMORY_VAR
from earl_lightning.core.host_memory import MALLOC_ENV, RETAIN_ENV
from earl_lightning.parallel.launch_env import standalone_env

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIDES = ("earl", "trl")
# --host-memory adds these sides: earl with glibc's malloc left as it is (as before it kept freed
# host memory), and TRL with glibc set as earl sets it (earl_lightning/core/host_memory.py).
HOST_MEMORY_SIDES = ("earl_glibc", "trl_retain")
SIDE_ENV = {
    "earl": {HOST_MEMORY_VAR: "retain"},
    "trl": {},
    "earl_glibc": {HOST_MEMORY_VAR: "glibc"},
    "trl_retain": RETAIN_ENV,
}
PAIRS = (("earl", "trl"), ("earl", "trl_retain"), ("earl_glibc", "trl"))
RESULT_TAG = "VS_TRL_RESULT "  # printed by benchmarks/vs_trl_sides.py
SLOW_FACTOR = 1.5
WORK_TOLERANCE = 0.10
RATIO_COLUMNS = [
    "pair",
    "mode",
    "completion_len",
    "turns",
    "speedup",
    "pairs",
    "ratio_min",
    "ratio_max",
    "work_diff",
    "equal_work",
    "both_learn",
    "noisy",
    "rollout_speedup",
    "train_speedup",
]
COLUMNS = [
    "side",
    "mode",
    "completion_len",
    "turns",
    "seconds_per_step",
    "tokens_per_s",
    "peak_rss_mib",
    "tokens_per_step",
    "reward_first",
    "reward_last",
    "runs",
    "flagged_runs",
    "rollout_s",
    "train_s",
]
RUN_COLUMNS = [
    "run",
    "side",
    "mode",
    "completion_len",
    "turns",
    "seconds_per_step",
    "tokens_per_s",
    "peak_rss_mib",
    "tokens_per_step",
    "reward_first",
    "reward_last",
    "guard_s",
    "slow_machine",
    "load_before",
    "load_after",
    "cpu_share",
    "rollout_s",
    "experience_s",
    "train_s",
    "peak_gpu_mib",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="1 run, 10 single-turn / 4 multi-turn steps (< 5 min)"
    )
    p.add_argument(
        "--runs", type=int, default=None, help="runs per side and mode (default 3, quick 1)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="RL steps per single-turn run (default 20, quick 10)",
    )
    p.add_argument(
        "--multi-steps",
        type=int,
        default=None,
        help="RL steps per multi-turn run (default 8, quick 4)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="first steps left out of the timing (default 2, quick 1)",
    )
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[8, 32], help="single-turn completion lengths"
    )
    p.add_argument("--modes", nargs="+", default=["single", "multi"], help="single and/or multi")
    p.add_argument(
        "--host-memory",
        action="store_true",
        help="also run earl with EARL_HOST_MEMORY=glibc and TRL with glibc's malloc set as earl sets it",
    )
    p.add_argument("--turns", type=int, default=10, help="turns per multi-turn episode")
    p.add_argument("--multi-length", type=int, default=8, help="tokens per multi-turn reply")
    p.add_argument("--batch", type=int, default=64, help="completions (episodes) per RL step")
    p.add_argument("--group", type=int, default=8, help="GRPO group size")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (both sides)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads per process")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one run may take before it is killed"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "vs_trl.csv")
    args = p.parse_args(argv)
    _defaults(args)
    _check(p, args)
    return args


def _defaults(args: argparse.Namespace) -> None:
    q = args.quick
    args.runs = args.runs if args.runs is not None else (1 if q else 3)
    args.steps = args.steps if args.steps is not None else (10 if q else 20)
    args.multi_steps = args.multi_steps if args.multi_steps is not None else (4 if q else 8)
    if args.warmup is None:
        args.warmup = min(1 if q else 2, min(args.steps, args.multi_steps) - 1)


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in (
        "runs",
        "steps",
        "multi_steps",
        "turns",
        "multi_length",
        "batch",
        "group",
        "threads",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.lengths) < 1:
        p.error(f"--lengths must all be >= 1, got {args.lengths}")
    bad = sorted(set(args.modes) - {"single", "multi"})
    if bad:
        p.error(f"--modes: unknown {bad}; valid: single, multi")
    if args.warmup < 0 or args.warmup >= min(args.steps, args.multi_steps):
        p.error(
            f"--warmup ({args.warmup}) must be >= 0 and smaller than --steps ({args.steps}) and --multi-steps "
            f"({args.multi_steps}): at least one step must be timed"
        )
    if args.group < 2 or args.batch % args.group:
        p.error(
            f"--batch ({args.batch}) must be a multiple of --group ({args.group}), and --group >= 2 (GRPO)"
        )
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")


def configs(args: argparse.Namespace) -> list[dict]:
    """(mode, completion_len, turns, steps) of every measured point."""
    out = []
    if "single" in args.modes:
        out += [
            {"mode": "single", "completion_len": n, "turns": 1, "steps": args.steps}
            for n in args.lengths
        ]
    if "multi" in args.modes:
        out.append(
            {
                "mode": "multi",
                "completion_len": args.multi_length,
                "turns": args.turns,
                "steps": args.multi_steps,
            }
        )
    return out


def run_side(side: str, cfg: dict, args: argparse.Namespace) -> dict:
    """One side of one point in a fresh process; the parsed result plus the load around it."""
    spec = {
        "side": side.split("_")[0],
        **cfg,
        "warmup": args.warmup,
        "batch": args.batch,
        "group": args.group,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "device": args.device,
    }
    # Each side is one standalone process: no process-group variables from whoever launched us
    # (accelerate, under TRL, would try to join that group).
    env = {
        **standalone_env(),
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    for name in (
        HOST_MEMORY_VAR,
        *MALLOC_ENV,
    ):  # a side's malloc setting is its own, not the caller's
        env.pop(name, None)
    env.update(SIDE_ENV[side])
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_trl_sides", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(
            f"the {side} run of {cfg} failed (exit {proc.returncode}); its output ends:\n{tail}"
        )
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    result.update(
        load_before=load_before, load_after=os.getloadavg()[0], wall_s=time.perf_counter() - t0
    )
    return result


def summarize(result: dict, warmup: int) -> dict:
    """Per-run figures from the per-step record of one process."""
    ends = result["ends"]
    spec = result["spec"]
    if len(ends) != spec["steps"] or len(result["rewards"]) != spec["steps"]:
        raise RuntimeError(
            f"the {spec['side']} run recorded {len(ends)} step ends and {len(result['rewards'])} "
            f"rewards for {spec['steps']} steps"
        )
    intervals = [b - a for a, b in zip([result["start"], *ends], ends)][warmup:]
    sec = statistics.fmean(intervals)
    # the share of `threads` cores the process used over the timed steps (low: it waited for the cores)
    cpu = result["cpu"]
    cpu_share = (
        (cpu[-1] - cpu[warmup - 1]) / (ends[-1] - ends[warmup - 1]) / spec["threads"]
        if warmup
        else math.nan
    )
    tokens = statistics.fmean(result["tokens"][warmup:])
    k = max(1, min(3, len(ends) // 4))
    stages = result["stages"][warmup:]
    stage = {
        f"{s}_s": statistics.fmean(x[f"stage/{s}/seconds"] for x in stages)
        if stages and all(f"stage/{s}/seconds" in x for x in stages)
        else ""
        for s in ("rollout", "experience", "train")
    }
    return {
        "side": spec["side"],
        "mode": spec["mode"],
        "completion_len": spec["completion_len"],
        "turns": spec["turns"],
        "seconds_per_step": sec,
        "tokens_per_s": tokens / sec,
        "peak_rss_mib": result["peak_rss_mib"],
        "tokens_per_step": tokens,
        "reward_first": statistics.fmean(result["rewards"][:k]),
        "reward_last": statistics.fmean(result["rewards"][-k:]),
        "guard_s": result["guard_s"],
        "load_before": result["load_before"],
        "load_after": result["load_after"],
        "cpu_share": cpu_share,
        "peak_gpu_mib": result["peak_gpu_mib"],
        **stage,
    }


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every run, the sides alternating A B / B A so that drifting load hits both alike."""
    rows = []
    sides = SIDES + (HOST_MEMORY_SIDES if args.host_memory else ())
    for run in range(args.runs):
        for i, cfg in enumerate(configs(args)):
            order = sides if (run + i) % 2 == 0 else sides[::-1]
            for side in order:
                row = {
                    "run": run,
                    **summarize(run_side(side, cfg, args), args.warmup),
                    "side": side,
                }
                rows.append(row)
                print(
                    f"run {run} {side:4s} {cfg['mode']:6s} len {cfg['completion_len']:2d}: "
                    f"{row['seconds_per_step']:.3f} s/step, reward {row['reward_first']:.2f} -> "
                    f"{row['reward_last']:.2f}, guard {row['guard_s']:.3f} s, load {row['load_before']:.2f}, "
                    f"cpu share {row['cpu_share']:.2f}",
                    flush=True,
                )
    fastest = min(r["guard_s"] for r in rows)
    for r in rows:
        r["slow_machine"] = r["guard_s"] > SLOW_FACTOR * fastest
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (side, mode, length): medians over the runs the guard did not flag."""
    out = []
    keys = sorted({(*point_of(r), r["side"]) for r in rows})
    for mode, n, turns, side in keys:
        group = [r for r in rows if (*point_of(r), r["side"]) == (mode, n, turns, side)]
        kept = [r for r in group if not r["slow_machine"]] or group
        med = {c: statistics.median(r[c] for r in kept) for c in COLUMNS[4:10]}
        for c in ("rollout_s", "train_s"):  # "" where a side did not record its stages
            med[c] = (
                statistics.median(r[c] for r in kept)
                if all(r.get(c) not in ("", None) for r in kept)
                else ""
            )
        out.append(
            {
                "side": side,
                "mode": mode,
                "completion_len": n,
                "turns": turns,
                **med,
                "runs": len(kept),
                "flagged_runs": sum(r["slow_machine"] for r in group),
                "only_flagged": all(r["slow_machine"] for r in kept),
            }
        )
    return out


def verdicts(summary: list[dict], rows: list[dict] | None = None) -> list[dict]:
    """Per point: the speed ratio (TRL s/step over earl s/step: > 1 means earl is faster), equal
    work (tokens per step within 10%) and whether both sides' rewards rose. Given the runs, also
    the ratio of each run's two sides (:func:`paired_ratios`): their lowest and highest."""
    out = []
    for earl, trl in PAIRS:
        out += [
            c for e in summary if e["side"] == earl for c in _verdict(e, summary, trl, rows or [])
        ]
    return out


def point_of(r: dict) -> tuple:
    """A row's point: (mode, completion_len, turns)."""
    return r["mode"], r["completion_len"], r["turns"]


def paired_ratios(rows: list[dict], earl: str, trl: str, point: tuple) -> list[float]:
    """TRL's seconds per step over earl's within each run index (the two ran back to back) at
    ``point`` (mode, completion_len, turns), for the runs where the guard flagged neither side.
    With n such pairs, all n above a target puts the median ratio above it with confidence
    1 - 2**-n (97% for 5), whatever the noise's distribution."""
    by_run: dict[int, dict[str, dict]] = {}
    for r in rows:
        if point_of(r) == point and r["side"] in (earl, trl):
            by_run.setdefault(r["run"], {})[r["side"]] = r
    return [
        p[trl]["seconds_per_step"] / p[earl]["seconds_per_step"]
        for _, p in sorted(by_run.items())
        if len(p) == 2 and not (p[earl]["slow_machine"] or p[trl]["slow_machine"])
    ]


def _verdict(e: dict, summary: list[dict], trl: str, rows: list[dict]) -> list[dict]:
    t = next((r for r in summary if r["side"] == trl and point_of(r) == point_of(e)), None)
    if t is None:
        return []
    work = abs(e["tokens_per_step"] - t["tokens_per_step"]) / max(t["tokens_per_step"], 1e-9)
    paired = paired_ratios(rows, e["side"], trl, point_of(e))
    return [
        {
            "pair": f"{e['side']} / {trl}",
            "mode": e["mode"],
            "completion_len": e["completion_len"],
            "turns": e["turns"],
            "speedup": t["seconds_per_step"] / e["seconds_per_step"],
            "work_diff": work,
            "equal_work": work <= WORK_TOLERANCE,
            "noisy": e["only_flagged"] or t["only_flagged"],
            "both_learn": e["reward_last"] > e["reward_first"]
            and t["reward_last"] > t["reward_first"],
            "pairs": len(paired),
            "ratios": paired,
            "ratio_min": min(paired, default=math.nan),
            "ratio_max": max(paired, default=math.nan),
            **{
                f"{s}_speedup": t[f"{s}_s"] / e[f"{s}_s"]
                if "" not in (t.get(f"{s}_s", ""), e.get(f"{s}_s", ""))
                else ""
                for s in ("rollout", "train")
            },
        }
    ]


def multi_turn_seconds(path: Path, completion_len: int, turns: int) -> dict[str, float]:
    """Seconds per step by side of one multi-turn point (``turns`` turns of ``completion_len``
    tokens) in a medians CSV this script wrote; sides without such a row are absent."""
    with path.open() as f:
        return {
            row["side"]: float(row["seconds_per_step"])
            for row in csv.DictReader(f)
            if (row["mode"], int(row["completion_len"]), int(row["turns"]))
            == ("multi", completion_len, turns)
        }


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()})


def print_report(
    summary: list[dict], checks: list[dict], loads: tuple[float, float], rows: list[dict]
) -> None:
    print(
        "\n| mode | tokens | turns | side | s/step | tokens/s | peak RSS MiB | tokens/step | reward first -> last | runs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in summary:
        print(
            f"| {r['mode']} | {r['completion_len']} | {r['turns']} | {r['side']} | {r['seconds_per_step']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} | {r['tokens_per_step']:.0f} | "
            f"{r['reward_first']:.2f} -> {r['reward_last']:.2f} | {r['runs']} ({r['flagged_runs']} flagged) |"
        )
    print(
        "\n| earl side / TRL side | mode | tokens | turns | earl speed / TRL | run by run (pairs) | tokens/step differ "
        "| equal work (<= 10%) | both rewards rose | timing |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in checks:
        print(
            f"| {c['pair']} | {c['mode']} | {c['completion_len']} | {c['turns']} | {c['speedup']:.2f}x | "
            f"{c['ratio_min']:.2f}-{c['ratio_max']:.2f}x ({c['pairs']}) | {100 * c['work_diff']:.1f}% | "
            f"{'yes' if c['equal_work'] else 'NO'} | {'yes' if c['both_learn'] else 'NO'} | "
            f"{'NOISY: only flagged runs' if c['noisy'] else 'ok'} |"
        )
    print_stages(summary, checks)
    guards = [r["guard_s"] for r in rows]
    print(
        f"\nload average (1 min): {loads[0]:.2f} before, {loads[1]:.2f} after; per run "
        f"{min(r['load_before'] for r in rows):.2f}-{max(r['load_after'] for r in rows):.2f}; machine-speed guard "
        f"{min(guards):.3f}-{max(guards):.3f} s, {sum(r['slow_machine'] for r in rows)} of {len(rows)} runs flagged "
        f"(> {SLOW_FACTOR}x the fastest); share of the cores a run got: "
        f"{min(r['cpu_share'] for r in rows):.2f}-{max(r['cpu_share'] for r in rows):.2f}"
    )


def print_stages(summary: list[dict], checks: list[dict]) -> None:
    """Where each side's step goes (medians): earl's rollout and train stages, TRL's generation
    and scoring and the rest of its training step, and the ratio of each part."""
    rows = [c for c in checks if "" not in (c["rollout_speedup"], c["train_speedup"])]
    if not rows:
        return
    print(
        "\n| earl side / TRL side | mode | tokens | turns | earl rollout s | TRL generation s | ratio "
        "| earl train s | TRL rest of training_step s | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in rows:
        earl, trl = c["pair"].split(" / ")
        e, t = (
            next(r for r in summary if r["side"] == side and point_of(r) == point_of(c))
            for side in (earl, trl)
        )
        print(
            f"| {c['pair']} | {c['mode']} | {c['completion_len']} | {c['turns']} | {e['rollout_s']:.3f} | "
            f"{t['rollout_s']:.3f} | {c['rollout_speedup']:.2f}x | {e['train_s']:.3f} | {t['train_s']:.3f} | "
            f"{c['train_speedup']:.2f}x |"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loads = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    rows = run_all(args)
    loads.append(os.getloadavg()[0])
    summary = medians(rows)
    checks = verdicts(summary, rows)
    paths = [
        args.out,
        *(args.out.with_name(f"{args.out.stem}_{kind}.csv") for kind in ("runs", "ratios")),
    ]
    for path, table, columns in zip(
        paths, (summary, rows, checks), (COLUMNS, RUN_COLUMNS, RATIO_COLUMNS)
    ):
        write_csv(path, table, columns)
    print_report(summary, checks, (loads[0], loads[1]), rows)
    print(
        f"\n{len(rows)} runs in {time.perf_counter() - t0:.0f} s; wrote {', '.join(map(str, paths))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""earl_lightning's own RL step at several git revisions, side by side: the tool that finds which
commit slowed a step down (issue 54's bisect of the margin over TRL).

Each revision is checked out once into a worktree under ``--work`` and runs *its own*
``benchmarks/vs_trl_sides.py`` (the earl side of ``benchmarks/vs_trl.py``: the same task, weights
and settings), one fresh process per run. The revisions alternate within every round and the order
rotates from round to round, so a neighbour that takes the cores for a while hurts all of them
alike. Per revision and point it reports the median seconds per step over the runs (each run's
mean after the warm-up steps), the stage split, the machine-speed guard and the load, and the ratio
to the first revision::

    python benchmarks/earl_revisions.py c1242d7 main --runs 3
    python benchmarks/earl_revisions.py c1242d7 abc1234 main --modes single --lengths 8

It prints a table and writes ``benchmarks/results/earl_revisions.csv`` (every run) and
``earl_revisions_summary.csv`` (medians and ratios).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import RESULT_TAG, summarize  # noqa: E402

BASE_FIELDS = ("side", "mode", "completion_len", "turns", "steps", "warmup", "threads", "seed")


def worktree(rev: str, work: Path) -> tuple[str, Path]:
    """The full sha of ``rev`` and a worktree of it under ``work`` (made once, reused)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if sha.returncode:
        raise SystemExit(f"earl_revisions: error: `{rev}` is not a commit of {ROOT}")
    sha_s = sha.stdout.strip()
    path = work / sha_s[:10]
    if not (path / "benchmarks" / "vs_trl_sides.py").exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), sha_s],
            check=True,
            capture_output=True,
        )
    return sha_s, path


def run_once(path: Path, spec: dict, timeout: float) -> dict:
    """One fresh process of the revision at ``path`` running ``spec``; its result record."""
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": str(spec["threads"])}
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_trl_sides", json.dumps(spec)],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(f"{path.name} {spec} failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len(RESULT_TAG) :])
    out.update(load_before=load_before, load_after=os.getloadavg()[0])
    out["wall_s"] = time.perf_counter() - t0
    return out


def points(args: argparse.Namespace) -> list[dict]:
    out = []
    if "single" in args.modes:
        out += [
            {"mode": "single", "completion_len": n, "turns": 1, "steps": args.steps}
            for n in args.lengths
        ]
    if "multi" in args.modes:
        out += [
            {"mode": "multi", "completion_len": 8, "turns": t, "steps": args.multi_steps}
            for t in args.turns
        ]
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    trees = [(rev, *worktree(rev, args.work)) for rev in args.revisions]
    rows = []
    for rnd in range(args.runs):
        k = rnd % len(trees)
        order = trees[k:] + trees[:k]  # rotate who goes first
        for point in points(args):
            for rev, sha, path in order:
                spec = {
                    "side": "earl",
                    "warmup": args.warmup,
                    "threads": args.threads,
                    "seed": 0,
                    **point,
                }
                result = run_once(path, spec, args.timeout)
                row = summarize(result, args.warmup)
                cpu, w = result["cpu"], args.warmup
                # CPU seconds per step: what neighbours on the cores inflate least
                row["cpu_s_per_step"] = (cpu[-1] - cpu[w - 1]) / (len(cpu) - w)
                row.update(revision=rev, sha=sha[:10], round=rnd)
                rows.append(row)
                print(
                    f"round {rnd} {rev:>10} {point['mode']:6} len {point['completion_len']:3} "
                    f"turns {point['turns']:2}: {row['seconds_per_step']:.4f} s/step "
                    f"cpu {row['cpu_s_per_step']:.4f} s "
                    f"(rollout {row['rollout_s'] or 0:.4f}, train {row['train_s'] or 0:.4f}) "
                    f"load {row['load_before']:.1f}",
                    flush=True,
                )
    return rows


def summary(rows: list[dict], revisions: list[str]) -> list[dict]:
    out = []
    keys = sorted({(r["mode"], r["completion_len"], r["turns"]) for r in rows})
    for mode, length, turns in keys:
        base = None
        for rev in revisions:
            runs = [
                r
                for r in rows
                if (r["revision"], r["mode"], r["completion_len"], r["turns"])
                == (rev, mode, length, turns)
            ]

            def med(key: str, runs: list[dict] = runs) -> float:
                vals = [float(r[key]) for r in runs if r[key] != ""]
                return statistics.median(vals) if vals else float("nan")

            sec, cpu = med("seconds_per_step"), med("cpu_s_per_step")
            base = (sec, cpu) if base is None else base
            out.append(
                {
                    "mode": mode,
                    "completion_len": length,
                    "turns": turns,
                    "revision": rev,
                    "sha": runs[0]["sha"],
                    "runs": len(runs),
                    "seconds_per_step": round(sec, 5),
                    "rollout_s": round(med("rollout_s"), 5),
                    "experience_s": round(med("experience_s"), 5),
                    "train_s": round(med("train_s"), 5),
                    "step_vs_first": round(sec / base[0], 3),
                    "cpu_s_per_step": round(cpu, 5),
                    "cpu_vs_first": round(cpu / base[1], 3),
                    "guard_s": round(med("guard_s"), 4),
                    "load": round(med("load_before"), 2),
                }
            )
    return out


def write(rows: list[dict], table: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("earl_revisions.csv", rows), ("earl_revisions_summary.csv", table)):
        with open(out / name, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(data[0]))
            writer.writeheader()
            writer.writerows(data)
    print(
        "\n| point | revision | s/step | rollout s | experience s | train s | step / first "
        "| CPU s/step | CPU / first | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        point = f"{r['mode']} {r['completion_len']} tok × {r['turns']}"
        print(
            f"| {point} | {r['revision']} ({r['sha']}) | {r['seconds_per_step']:.4f} | "
            f"{r['rollout_s']:.4f} | {r['experience_s']:.4f} | {r['train_s']:.4f} | "
            f"{r['step_vs_first']:.3f} | {r['cpu_s_per_step']:.4f} | {r['cpu_vs_first']:.3f} | "
            f"{r['load']:.1f} |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("revisions", nargs="+", help="git revisions; the first is the reference")
    p.add_argument("--runs", type=int, default=3, help="rounds (one run per revision and point)")
    p.add_argument("--modes", nargs="+", default=["single", "multi"], choices=["single", "multi"])
    p.add_argument("--lengths", nargs="+", type=int, default=[8, 32])
    p.add_argument("--turns", nargs="+", type=int, default=[10])
    p.add_argument("--steps", type=int, default=20, help="steps per single-turn run")
    p.add_argument("--multi-steps", type=int, default=8, help="steps per multi-turn run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (>= 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--work", type=Path, default=Path("/tmp/earl_revisions"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"earl_revisions: error: --runs must be >= 1, got {args.runs}")
    if not 1 <= args.warmup < min(args.steps, args.multi_steps):
        raise SystemExit(
            f"earl_revisions: error: --warmup must be >= 1 and below the steps, got {args.warmup}"
        )
    args.work.mkdir(parents=True, exist_ok=True)
    rows = measure(args)
    write(rows, summary(rows, args.revisions), args.out)


if __name__ == "__main__":
    main()

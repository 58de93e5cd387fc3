"""Learning parity with TRL: GRPO on the addition task from the same warm start, earl_lightning
and TRL 1.16's ``GRPOTrainer``, the same rows and settings, seeds 0, 1, 2.

Each run is one side in a fresh process (``benchmarks/vs_trl_learning_side.py``); per seed the
sides alternate order (earl first for seed 0, TRL first for seed 1, ...). Both are evaluated by the
same function at the same steps (greedy, the first ``--eval-rows`` held-out rows, TRL's
``accuracy_reward``); the clock is training time only (evaluations left out). The questions it
answers: after the same number of steps, is earl's held-out accuracy at least TRL's (within two
standard errors over seeds)? And how long does earl take to reach TRL's final accuracy, against
TRL's whole run (goal: at most 1/1.5 of it)?

    python benchmarks/vs_trl_learning.py --warm-starts runs/seeds/addition/seed{0,1,2}/warm_start

Writes ``benchmarks/results/vs_trl_learning_points.csv`` (every evaluation of every run),
``vs_trl_learning.csv`` (per seed and side: final accuracy, training seconds, earl's time to
TRL's final accuracy) and ``vs_trl_learning.png`` (accuracy against training seconds and
against steps), and prints the table with the machine's load before and after each run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages, `benchmarks` included

from benchmarks.vs_trl import write_csv  # noqa: E402
from earl_lightning.parallel.launch_env import standalone_env  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RESULT_TAG = "VS_TRL_LEARNING "
POINT_COLUMNS = ["seed", "side", "step", "train_s", "accuracy"]
RUN_COLUMNS = [
    "seed",
    "side",
    "first_accuracy",
    "final_accuracy",
    "train_s",
    "seconds_per_step",
    "earl_s_to_trl_final",
    "time_ratio",
    "load_before",
    "load_after",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--warm-starts",
        nargs="+",
        required=True,
        help="one warm start directory per seed, in order",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train", default=str(ROOT / "data" / "addition" / "train.jsonl"))
    p.add_argument("--test", default=str(ROOT / "data" / "addition" / "test.jsonl"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument(
        "--recipe",
        default=str(ROOT / "recipes" / "addition_grpo_warm.yaml"),
        help="the GRPO recipe whose settings both sides take (lr, KL, clip, batch, group, tokens)",
    )
    p.add_argument("--out", default=str(RESULTS / "vs_trl_learning"))
    p.add_argument("--timeout", type=int, default=3600)
    args = p.parse_args(argv)
    if len(args.warm_starts) != len(args.seeds):
        p.error(
            f"--warm-starts gives {len(args.warm_starts)} directories for {len(args.seeds)} seeds; give one per seed"
        )
    return args


def recipe_settings(path: str) -> dict:
    """The learning settings of the GRPO recipe, as the side script's fields."""
    import yaml

    cfg = yaml.safe_load(Path(path).read_text())
    m, d = cfg["model"], cfg["data"]
    loss, sampling = m["algorithm"]["loss"], m["rollout"]["sampling"]
    return {
        "lr": m["optim"]["lr"],
        "kl": m["algorithm"].get("kl", {}).get("coef", 0.0),
        "clip_low": loss["clip_low"],
        "clip_high": loss["clip_high"],
        "batch": d["batch_size"],
        "group": d["group_size"],
        "max_new_tokens": sampling["max_new_tokens"],
        "temperature": sampling.get("temperature", 1.0),
    }


def run_side(spec: dict, timeout: int) -> dict:
    env = {
        **standalone_env(),
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    load_before = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_trl_learning_side", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"the {spec['side']} run of seed {spec['seed']} failed (exit {proc.returncode}); its "
            f"output ends:\n{(proc.stderr or proc.stdout)[-3000:]}"
        )
    out = json.loads(lines[-1][len(RESULT_TAG) :])
    out.update(load_before=load_before, load_after=os.getloadavg()[0])
    return out


def time_to_reach(points: list[dict], target: float) -> float:
    """Training seconds at the first evaluation whose accuracy is at least ``target`` (inf: never)."""
    return next((p["train_s"] for p in points if p["accuracy"] >= target - 1e-9), math.inf)


def summarize(runs: dict[tuple[int, str], dict]) -> list[dict]:
    rows = []
    for (seed, side), r in sorted(runs.items()):
        pts = r["points"]
        row = {
            "seed": seed,
            "side": side,
            "first_accuracy": pts[0]["accuracy"],
            "final_accuracy": pts[-1]["accuracy"],
            "train_s": pts[-1]["train_s"],
            "seconds_per_step": pts[-1]["train_s"] / max(pts[-1]["step"], 1),
            "load_before": r["load_before"],
            "load_after": r["load_after"],
        }
        trl = runs.get((seed, "trl"))
        if side == "earl" and trl is not None:
            reach = time_to_reach(pts, trl["points"][-1]["accuracy"])
            row.update(earl_s_to_trl_final=reach, time_ratio=reach / trl["points"][-1]["train_s"])
        rows.append(row)
    return rows


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)


def verdict(rows: list[dict]) -> list[str]:
    earl = [r for r in rows if r["side"] == "earl"]
    trl = [r for r in rows if r["side"] == "trl"]
    (me, se_e), (mt, se_t) = (
        mean_se([r["final_accuracy"] for r in earl]),
        mean_se([r["final_accuracy"] for r in trl]),
    )
    diffs = [e["final_accuracy"] - t["final_accuracy"] for e, t in zip(earl, trl)]
    md, se_d = mean_se(diffs)
    ratios = [r["time_ratio"] for r in earl]
    return [
        f"final held-out accuracy: earl {me:.3f} +- {se_e:.3f}, TRL {mt:.3f} +- {se_t:.3f} (mean +- SE over "
        f"{len(earl)} seeds); earl - TRL per seed {md:+.3f} +- {se_d:.3f}: "
        f"{'met' if md >= -2 * (se_d if se_d == se_d else 0.0) else 'NOT met'} (earl >= TRL within two SE)",
        f"earl's time to TRL's final accuracy / TRL's time: {', '.join(f'{x:.2f}' for x in ratios)} "
        f"(goal <= {1 / 1.5:.2f}): {'met' if all(x <= 1 / 1.5 for x in ratios) else 'NOT met'} on every seed",
    ]


def plot(runs: dict[tuple[int, str], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"earl": "tab:blue", "trl": "tab:orange"}
    for (seed, side), r in sorted(runs.items()):
        pts = r["points"]
        label = f"{side} seed {seed}"
        axes[0].plot(
            [p["train_s"] for p in pts],
            [p["accuracy"] for p in pts],
            marker="o",
            color=colors[side],
            alpha=0.5 + 0.15 * seed,
            label=label,
        )
        axes[1].plot(
            [p["step"] for p in pts],
            [p["accuracy"] for p in pts],
            marker="o",
            color=colors[side],
            alpha=0.5 + 0.15 * seed,
            label=label,
        )
    axes[0].set_xlabel("training seconds (evaluation excluded)")
    axes[1].set_xlabel("GRPO step")
    for ax in axes:
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("addition GRPO from the same warm start: earl_lightning vs TRL GRPOTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = {
        **recipe_settings(args.recipe),
        "train": args.train,
        "test": args.test,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_rows": args.eval_rows,
    }
    runs: dict[tuple[int, str], dict] = {}
    t0 = time.perf_counter()
    for k, (seed, warm) in enumerate(zip(args.seeds, args.warm_starts)):
        for side in ("earl", "trl") if k % 2 == 0 else ("trl", "earl"):
            runs[(seed, side)] = run_side(
                {**base, "side": side, "seed": seed, "model": warm}, args.timeout
            )
            print(
                f"seed {seed} {side}: {[(p['step'], round(p['accuracy'], 3)) for p in runs[(seed, side)]['points']]}",
                flush=True,
            )
    rows = summarize(runs)
    out = Path(args.out)
    points = [
        {"seed": s, "side": side, **p} for (s, side), r in sorted(runs.items()) for p in r["points"]
    ]
    write_csv(out.with_name(out.name + "_points.csv"), points, POINT_COLUMNS)
    write_csv(out.with_suffix(".csv"), rows, RUN_COLUMNS)
    plot(runs, out.with_suffix(".png"))
    print(
        f"\n{'seed':>4} {'side':>5} {'first':>6} {'final':>6} {'train_s':>8} {'s/step':>7} {'earl_s_to_trl':>13} "
        f"{'ratio':>6} {'load':>9}"
    )
    for r in rows:
        print(
            f"{r['seed']:>4} {r['side']:>5} {r['first_accuracy']:6.3f} {r['final_accuracy']:6.3f} {r['train_s']:8.1f} "
            f"{r['seconds_per_step']:7.3f} {r.get('earl_s_to_trl_final', math.nan):13.1f} "
            f"{r.get('time_ratio', math.nan):6.2f} {r['load_before']:4.1f}/{r['load_after']:4.1f}"
        )
    for line in verdict(rows):
        print(line)
    print(f"({time.perf_counter() - t0:.0f} s in all; CSV and PNG under {out.parent})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

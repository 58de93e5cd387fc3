"""Run a recipe over several seeds (optionally after its warm start) and report the evaluation curves.

    python scripts/seeds.py --sft recipes/connect4_sft.yaml --config recipes/connect4_grpo_warm.yaml \
        --seeds 0 1 2 --out docs/experiments/results/connect4_grpo_warm

For each seed ``s``: ``earl sft`` (with ``--sft``; seed ``s`` for the demonstrations and the
model's sampling) into ``<out>/seed<s>/warm_start``, then ``earl fit`` from it (or from the
recipe's own model) with ``seed_everything``, ``--model.seed`` and ``--data.seed`` set to ``s``.
Writes ``<out>/curves.csv`` (seed, step, metric, value: the greedy held-out evaluation, step 0 =
the starting model), ``<out>/summary.csv`` (per seed: start and final figures, the warm start's
sampled figures, wall times) and ``<out>/curves.png`` (each seed's curve and the mean). Extra
arguments after ``--`` go to ``earl fit``; ``--sft-arg=<flag>=<value>`` (repeatable) passes one to
``earl sft`` (e.g. ``--sft-arg=--model.model=earl-tiny-4l``). ``--warm-starts <dir>`` reuses the
warm starts that an earlier run with ``--sft`` saved there (the same warm starts for GRPO and PPO).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from _rows import report_rows

METRICS = (
    "val/win_rate",
    "val/invalid_rate",
    "val/accuracy",
    "val/tool_use_rate",
    "val/right_tool_rate",
    "val/reward",
)
SAMPLED = ("win_rate", "invalid_rate", "accuracy", "tool_use_rate", "right_tool_rate", "reward")
REWARD_FUNCTIONS = "val/rewards/"  # each reward function's evaluation (a dataset task) is read too


def run(cmd: list[str], log: Path) -> float:
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(
            f"error: {' '.join(cmd[2:5])}... failed (exit {proc.returncode}); see {log}"
        )
    return time.monotonic() - start


def one_seed(args: argparse.Namespace, seed: int) -> dict:
    root = args.out / f"seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    earl = [sys.executable, "-m", "earl_lightning.cli"]
    common = [f"--seed_everything={seed}", "--trainer.enable_progress_bar=false"]
    record: dict = {"seed": seed, "sft_wall_s": 0.0}
    fit = [
        *earl,
        "fit",
        "--config",
        str(args.config),
        *common,
        f"--model.seed={seed}",
        f"--data.seed={seed}",
        f"--trainer.default_root_dir={root / 'rl'}",
    ]
    if args.warm_starts is not None:  # another seeds.py output's warm starts, one per seed
        warm = args.warm_starts / f"seed{seed}" / "warm_start"
        fit.append(f"--model.model={warm}")
        record.update(_sampled(warm))
    elif args.sft is not None:
        warm = root / "warm_start"
        record["sft_wall_s"] = run(
            [
                *earl,
                "sft",
                "--config",
                str(args.sft),
                *common,
                f"--model.seed={seed}",
                f"--data.seed={seed}",
                f"--output_dir={warm}",
                "--overwrite",
                f"--trainer.default_root_dir={root / 'sft'}",
                *args.sft_args,
            ],
            root / "sft.log",
        )
        fit.append(f"--model.model={warm}")
        record.update(_sampled(warm))
    record["rl_wall_s"] = run([*fit, *args.fit_args], root / "fit.log")
    (root / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    record["curves"] = read_curves(root / "rl")
    return record


def reread_seed(args: argparse.Namespace, seed: int) -> dict:
    """``--report``: a finished seed's record again (its curves and warm-start figures re-read)."""
    root = args.out / f"seed{seed}"
    if (root / "record.json").is_file():
        record = json.loads((root / "record.json").read_text())
    else:  # written before record.json existed: the wall times of the summary it printed
        with (args.out / "summary.csv").open() as f:
            row = next(r for r in csv.DictReader(f) if int(r["seed"]) == seed)
        record = {
            "seed": seed,
            "sft_wall_s": float(row["sft_wall_s"]),
            "rl_wall_s": float(row["rl_wall_s"]),
        }
    warm = (args.warm_starts or args.out) / f"seed{seed}" / "warm_start"
    if warm.is_dir():
        record.update(_sampled(warm))
    record["curves"] = read_curves(root / "rl")
    return record


def _sampled(warm: Path) -> dict[str, float]:
    """The warm start's temperature-1 figures (its greedy ones are the RL curve's step 0)."""
    evaluation = json.loads((warm / "warm_start.json").read_text())["evaluation"]
    return {
        f"warm_sampled/{k.split('/', 1)[1]}": v
        for k, v in evaluation.items()
        if k.startswith("val_sampled/")
        and (k.split("/", 1)[1] in SAMPLED or k.startswith("val_sampled/rewards/"))
    }


def read_curves(root: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(root.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    acc = EventAccumulator(str(events[-1].parent), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # an evaluation after k updates is logged at step k (the one before any update at 0)
    wanted = [m for m in METRICS if m in tags] + sorted(
        t for t in tags if t.startswith(REWARD_FUNCTIONS)
    )
    return {m: [(e.step, e.value) for e in acc.Scalars(m)] for m in wanted}


def write(records: list[dict], out: Path) -> None:
    with (out / "curves.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "step", "metric", "value"])
        for r in records:
            for metric, points in r["curves"].items():
                w.writerows([r["seed"], step, metric, f"{value:.4f}"] for step, value in points)
    rows = []
    for r in records:
        row = {"seed": r["seed"]}
        for metric, points in r["curves"].items():
            name = metric.split("/", 1)[1]
            row[f"start_{name}"], row[f"final_{name}"] = (
                round(points[0][1], 4),
                round(points[-1][1], 4),
            )
        row.update({k: round(v, 4) for k, v in r.items() if k.startswith("warm_sampled/")})
        row.update(sft_wall_s=round(r["sft_wall_s"]), rl_wall_s=round(r["rl_wall_s"]))
        rows.append(row)
    report_rows(rows, out / "summary.csv")


def plot(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    functions = sorted({m for r in records for m in r["curves"] if m.startswith(REWARD_FUNCTIONS)})
    shown = [m for m in [*METRICS[:-1], *functions] if all(m in r["curves"] for r in records)] or [
        METRICS[-1]
    ]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
    for ax, metric in zip(axes[0], shown):
        for r in records:
            steps, values = zip(*r["curves"][metric])
            ax.plot(steps, values, lw=1, alpha=0.6, label=f"seed {r['seed']}")
        common = sorted(
            set.intersection(*(set(s for s, _ in r["curves"][metric]) for r in records))
        )
        mean = [np.mean([dict(r["curves"][metric])[s] for r in records]) for s in common]
        ax.plot(common, mean, lw=2.5, color="black", label="mean")
        ax.set(xlabel="RL step (0: the starting model)", ylabel=metric, title=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="the RL recipe (earl fit)")
    parser.add_argument(
        "--sft", type=Path, default=None, help="the warm-start recipe (earl sft), run first"
    )
    parser.add_argument(
        "--warm-starts",
        type=Path,
        default=None,
        help="start from the warm starts of an earlier seeds.py --sft output (<dir>/seed<s>/warm_start)",
    )
    parser.add_argument(
        "--sft-arg",
        dest="sft_args",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="one more argument of earl sft, written --sft-arg=--data.num_episodes=500 (repeatable)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: re-read the seeds under --out and report",
    )
    parser.add_argument("fit_args", nargs="*", help="after --: more arguments of earl fit")
    args = parser.parse_args()
    for path, name in ((args.config, "--config"), (args.sft, "--sft")):
        if path is not None and not path.is_file():
            raise SystemExit(f"error: `{name}` {str(path)!r} is not a file")
    if args.sft_args and args.sft is None:
        raise SystemExit(
            f"error: `--sft-arg` {args.sft_args[0]!r} needs `--sft` (no warm start is run without it)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    records = [(reread_seed if args.report else one_seed)(args, seed) for seed in args.seeds]
    write(records, args.out)
    plot(
        records,
        args.out,
        f"{args.config.stem}{' after ' + args.sft.stem if args.sft else ''}: "
        f"seeds {' '.join(map(str, args.seeds))}",
    )


if __name__ == "__main__":
    main()

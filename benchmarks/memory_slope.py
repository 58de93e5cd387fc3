"""Long-run memory stability: the resident memory of a 500-step CPU run, and its slope after warm-up.

Runs the default recipe (`recipes/connect4_ppo.yaml`) with a small batch for ``--steps`` RL steps
in this process, recording the process's resident set size (RSS, from /proc/self/statm) at the
end of every step, together with how much of it Python's allocator and torch hold. After
``--warmup`` steps the RSS should stay flat: a leak in KV caches, transcripts, metrics or engines
shows as a positive slope. Prints a table, writes ``benchmarks/results/memory_slope.csv``
(``step,rss_mib``) and ``memory_slope.png``, and the fitted slope in MiB per 100 steps.

    python benchmarks/memory_slope.py                 # 500 steps, batch 8 (about 4 minutes on 2 cores)
    python benchmarks/memory_slope.py --steps 60 --warmup 20 --out /tmp/slope   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
from pathlib import Path

import lightning as L

RESULTS = Path(__file__).parent / "results"
RECIPE = Path(__file__).parents[1] / "recipes" / "connect4_ppo.yaml"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Recorder(L.Callback):
    """The process's resident memory after every training step, after a garbage collection (what
    stays alive). The `earl` command builds it from its import path, so the rows live on the class."""

    rows: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        gc.collect()
        Recorder.rows.append((trainer.global_step, rss_mib()))


def slope_per_100(rows: list[tuple[int, float]], warmup: int) -> tuple[float, float]:
    """Least-squares slope of RSS over steps after ``warmup`` (MiB per 100 steps), and the
    spread (max - min MiB) over that range."""
    pts = [(s, r) for s, r in rows if s > warmup]
    if len(pts) < 2:
        raise ValueError(
            f"`--steps` must exceed `--warmup` by at least 2 steps, got {len(rows)} steps, warmup {warmup}"
        )
    xs, ys = [s for s, _ in pts], [r for _, r in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 100 * slope, max(ys) - min(ys)


def windows(rows: list[tuple[int, float]], size: int = 50) -> list[tuple[int, float, float, float]]:
    """(last step, minimum, median, maximum RSS) of every ``size``-step window. The minimum is what
    stays allocated between steps; the maximum also holds the step's transient tensors, which grow
    with the episodes (games last longer as the policy learns), so a leak shows in the minimum."""
    out = []
    for end in range(size, rows[-1][0] + 1, size):
        w = [r for s, r in rows if end - size < s <= end]
        out.append((end, min(w), statistics.median(w), max(w)))
    return out


def run(steps: int, batch: int, root: Path) -> list[tuple[int, float]]:
    import importlib
    import sys

    from earl_lightning.cli import main

    sys.path.insert(0, str(Path(__file__).parents[1]))  # the CLI imports the callback by its path
    recorder = importlib.import_module("benchmarks.memory_slope").Recorder  # not __main__'s copy
    recorder.rows = []
    main(
        [
            "fit",
            "--config",
            str(RECIPE),
            "--trainer.max_steps",
            str(steps),
            "--trainer.default_root_dir",
            str(root),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.callbacks+=benchmarks.memory_slope.Recorder",
            "--data.batch_size",
            str(batch),
            "--data.group_size",
            "4",
            "--data.eval_episodes",
            "0",
        ]
    )
    return recorder.rows


def write(rows: list[tuple[int, float]], out: Path, warmup: int, slope: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory_slope.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "rss_mib"])
        w.writerows((s, f"{r:.2f}") for s, r in rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s for s, _ in rows], [r for _, r in rows], lw=1)
    ax.axvline(warmup, color="grey", ls="--", lw=0.8, label=f"warm-up ({warmup} steps)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("RSS (MiB)")
    ax.legend()
    ax.set_title(f"resident memory per step; slope after warm-up {slope:+.2f} MiB / 100 steps")
    fig.tight_layout()
    fig.savefig(out / "memory_slope.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=100, help="steps before the slope is fitted")
    p.add_argument("--batch", type=int, default=8, help="episodes per RL step")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.steps < 2 or a.warmup < 0 or a.batch < 4 or a.batch % 4:
        p.error(
            f"need --steps >= 2, --warmup >= 0 and --batch a positive multiple of 4; got {vars(a)}"
        )
    rows = run(a.steps, a.batch, a.out / "memory_slope_run")
    slope, spread = slope_per_100(rows, a.warmup)
    table = windows(rows)
    print(f"{'steps to':>9} {'min MiB':>9} {'median':>9} {'max':>9}")
    for end, lo, mid, hi in table:
        print(f"{end:9d} {lo:9.1f} {mid:9.1f} {hi:9.1f}")
    floor = (
        slope_per_100([(end, lo) for end, lo, _, _ in table], a.warmup)[0]
        if len(table) > 2
        else float("nan")
    )
    print(
        f"slope after step {a.warmup}: every step {slope:+.3f} MiB per 100 steps (spread {spread:.1f} MiB); "
        f"the floor (window minima) {floor:+.3f} MiB per 100 steps"
    )
    write(rows, a.out, a.warmup, slope)


if __name__ == "__main__":
    main()

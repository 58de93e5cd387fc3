"""Every recorded set of ``benchmarks/vs_trl.py`` runs, read back and compared with their targets.

Each ``*_runs.csv`` that ``vs_trl.py`` wrote is one set: one machine, one session, its sides
interleaved. Per set and point (mode, completion length, turns) this gives earl's speed over TRL's
(TRL's seconds per step over earl's) as ``vs_trl.py`` computes it: of the medians over the runs the
machine-speed guard did not flag, and run by run (the two sides of one run index ran back to back).
A point is *settled* at its target (1.5x single-turn, 3x multi-turn) when every one of at least
``--min-pairs`` pairs reaches it: with n pairs all above the target, the median ratio is above it
with confidence 1 - 2**-n whatever the noise. Rows ``all sets`` pool every set's pairs per point
(:func:`pooled`). The guard's median seconds (a fixed matmul workload)
says how fast the set's machine was: lower is faster.

    python benchmarks/vs_trl_sets.py          # every benchmarks/results/vs_trl*_runs.csv, oldest first
    python benchmarks/vs_trl_sets.py A_runs.csv B_runs.csv ...   # these, in this order (the plot's)

Writes ``benchmarks/results/vs_trl_sets.csv`` and ``vs_trl_sets.png`` (each pair's ratio per set,
the median as a bar, the target as a line) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.vs_trl import RESULTS, medians, point_of, verdicts, write_csv  # noqa: E402

TARGETS = {"single": 1.5, "multi": 3.0}
SET_COLUMNS = [
    "set",
    "mode",
    "completion_len",
    "turns",
    "target",
    "guard_s",
    "runs_earl",
    "runs_trl",
    "speedup",
    "pairs",
    "ratio_min",
    "ratio_max",
    "pairs_at_target",
    "settled",
    "confidence",
    "ratios",
]
_INT = ("run", "completion_len", "turns")
_STR = ("side", "mode")


def read_runs(path: Path) -> list[dict]:
    """The rows of a ``vs_trl.py`` runs CSV, typed as ``vs_trl.py`` made them."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows or "seconds_per_step" not in rows[0]:
        raise ValueError(
            f"{path}: not a vs_trl.py runs CSV (no rows, or no seconds_per_step column)"
        )
    out = []
    for r in rows:
        typed = {
            k: (
                v
                if k in _STR
                else int(v)
                if k in _INT
                else v == "True"
                if k == "slow_machine"
                else float(v)
                if v != ""
                else math.nan
            )
            for k, v in r.items()
        }
        out.append(typed)
    return out


def recorded_order(files: list[Path]) -> list[Path]:
    """``files`` oldest first: by the time of the commit that added each (a fresh clone keeps it; file
    times do not), else by the file's modification time, then by name."""

    def when(f: Path) -> float:
        try:
            out = subprocess.run(
                ["git", "log", "--diff-filter=A", "--format=%ct", "--", f.name],
                cwd=f.parent,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        return float(out[-1]) if out else f.stat().st_mtime

    return sorted(files, key=lambda f: (when(f), f.name))


def _against_target(ratios: list[float], target: float, min_pairs: int) -> dict:
    """How many pairs reach ``target``, whether all of at least ``min_pairs`` do (settled), and then
    the confidence that the median pair is above it; ``pair_ratios`` keeps the floats, ``ratios``
    is their text for the CSV."""
    at = sum(x >= target for x in ratios)
    settled = len(ratios) >= min_pairs and at == len(ratios)
    return {
        "target": target,
        "pairs": len(ratios),
        "pairs_at_target": at,
        "settled": settled,
        "confidence": 1 - 2.0 ** -len(ratios) if settled else math.nan,
        "pair_ratios": ratios,
        "ratios": " ".join(f"{x:.2f}" for x in ratios),
    }


def set_points(name: str, rows: list[dict], min_pairs: int) -> list[dict]:
    """One row per point of a set where both earl and TRL (as shipped) ran."""
    summary = medians(rows)
    out = []
    for c in verdicts(summary, rows):
        if c["pair"] != "earl / trl":
            continue
        runs = {r["side"]: r["runs"] for r in summary if point_of(r) == point_of(c)}
        out.append(
            {
                "set": name,
                "mode": c["mode"],
                "completion_len": c["completion_len"],
                "turns": c["turns"],
                "guard_s": statistics.median(r["guard_s"] for r in rows),
                "runs_earl": runs["earl"],
                "runs_trl": runs["trl"],
                "speedup": c["speedup"],
                "ratio_min": c["ratio_min"],
                "ratio_max": c["ratio_max"],
                **_against_target(c["ratios"], TARGETS[c["mode"]], min_pairs),
            }
        )
    return out


def pooled(points: list[dict], min_pairs: int) -> list[dict]:
    """Per point, every set's run-by-run pairs together (set ``all sets``): each pair compares the two
    sides on one machine, so with n pairs all at the target the median pair over these machines and
    runs is above it with confidence 1 - 2**-n. ``speedup`` is then the median pair."""
    out = []
    for key in dict.fromkeys(point_of(p) for p in points):
        rows = [p for p in points if point_of(p) == key]
        ratios = sorted(x for p in rows for x in p["pair_ratios"])
        if not ratios:
            continue
        out.append(
            {
                "set": "all sets",
                "mode": key[0],
                "completion_len": key[1],
                "turns": key[2],
                "guard_s": math.nan,
                "runs_earl": sum(p["runs_earl"] for p in rows),
                "runs_trl": sum(p["runs_trl"] for p in rows),
                "speedup": statistics.median(ratios),
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
                **_against_target(ratios, rows[0]["target"], min_pairs),
            }
        )
    return out


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({point_of(p) for p in points}, key=lambda k: (k[0] != "single", k))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = [p for p in points if point_of(p) == key]
        for i, p in enumerate(rows):
            ax.scatter([i] * p["pairs"], p["pair_ratios"], s=14, color="tab:blue", zorder=3)
            ax.hlines(p["speedup"], i - 0.3, i + 0.3, color="black", lw=2, zorder=2)
        ax.axhline(rows[0]["target"], color="tab:red", ls="--", lw=1)
        ax.set_xticks(
            range(len(rows)),
            [p["set"].removeprefix("vs_trl_") for p in rows],
            rotation=60,
            ha="right",
            fontsize=7,
        )
        ax.set_title(
            f"{key[0]}, {key[1]} tokens" + (f" x {key[2]} turns" if key[2] > 1 else ""), fontsize=9
        )
        ax.set_ylabel("earl speed / TRL (dots: run by run; bar: medians)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(points: list[dict]) -> None:
    print(
        "| set | mode | tokens | turns | guard s | ratio of medians (all sets: median pair) | run by run | at target "
        "| settled |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in points:
        guard = "-" if math.isnan(p["guard_s"]) else f"{p['guard_s']:.3f}"
        print(
            f"| {p['set']} | {p['mode']} | {p['completion_len']} | {p['turns']} | {guard} | "
            f"{p['speedup']:.2f}x | {p['ratios'] or '-'} | {p['pairs_at_target']}/{p['pairs']} of "
            f"{p['target']:g}x | {'yes' if p['settled'] else 'no'} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "runs_files",
        nargs="*",
        type=Path,
        help="vs_trl.py runs CSVs (default: every benchmarks/results/vs_trl*_runs.csv)",
    )
    ap.add_argument(
        "--min-pairs", type=int, default=5, help="pairs a settled point needs (default 5: 97%%)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "vs_trl_sets.csv")
    args = ap.parse_args(argv)
    if args.min_pairs < 1:
        ap.error(f"--min-pairs must be >= 1, got {args.min_pairs}")
    files = args.runs_files or recorded_order(list(RESULTS.glob("vs_trl*_runs.csv")))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        ap.error(
            f"runs_files: no such file: {', '.join(missing)}"
            if missing
            else "runs_files: none found"
        )
    try:
        sets = [(f.name.removesuffix("_runs.csv"), read_runs(f)) for f in files]
    except ValueError as e:
        ap.error(f"runs_files: {e}")
    points = [p for name, rows in sets for p in set_points(name, rows, args.min_pairs)]
    plot(points, args.out.with_suffix(".png"))
    points += pooled(points, args.min_pairs)
    write_csv(args.out, points, SET_COLUMNS)
    print_table(points)
    print(f"\nwrote {args.out}, {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

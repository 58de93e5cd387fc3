"""``benchmarks/slow_calls.py`` smoke-run (8 episodes x 3 turns, one repeat): every mode runs, the
table and the CSVs are written, and the modes order as they must (sequential slowest). Timing
thresholds live in the benchmark, not here."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_slow_calls_benchmark_runs(tmp_path):
    out = tmp_path / "slow_calls.csv"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "slow_calls.py"),
            "--quick",
            "--cases",
            "uniform",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with out.with_name("slow_calls_summary.csv").open() as f:
        rows = {r["mode"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"sequential", "concurrent", "continuous"}
    assert float(rows["sequential"]["slowest_chain_s"]) == 1.5  # 3 turns x 0.5 s
    seconds = {m: float(r["seconds"]) for m, r in rows.items()}
    assert seconds["sequential"] > 8 * 3 * 0.5, "one call at a time: at least the sum of the calls"
    assert seconds["continuous"] < seconds["sequential"]
    assert out.with_suffix(".png").stat().st_size > 10_000 and "goal" in proc.stdout

"""``benchmarks/step_overheads.py`` smoke-run (one repeat, a few rollouts and steps): the three
costs are measured on both sides and the CSV and table are written; ``benchmarks/earl_revisions.py``
refuses a revision that is not a commit in one line. Timing thresholds live in the benchmarks."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_step_overheads_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "step_overheads.py"),
            "--repeats",
            "1",
            "--rollouts",
            "2",
            "--steps",
            "12",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (tmp_path / "step_overheads.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["what"], r["side"]) for r in rows} == {
        ("env calls", "threads"),
        ("env calls", "here"),
        ("step metrics", "log_dict"),
        ("step metrics", "loggers"),
        ("chat renders", "before"),
        ("chat renders", "now"),
    }
    assert all(float(r["ms"]) > 0 for r in rows)
    assert all(f"| {what}" in proc.stdout for what in ("env calls", "step metrics", "chat renders"))


def test_the_revisions_benchmark_refuses_an_unknown_revision(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "earl_revisions.py"),
            "no-such-rev",
            "--work",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("earl_revisions: error: `no-such-rev` is not a commit")
    )

"""``benchmarks/train_cpu_paths.py`` runs end to end (its train pass checks that every variant
gives the same log-probs) and writes one row per attention length, one for the RMSNorm and one per
train-pass variant, each saying whether the trainer takes the path there. Timing is not asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_script_runs_and_writes_its_csv(tmp_path):
    out = tmp_path / "paths.csv"
    args = ["--repeats", "1", "--batch", "2", "--threads", "1", "--lengths", "300", "384"]
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_cpu_paths.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [
        (r["what"], r["length"], r["variant"], r["applied"]) for r in csv.DictReader(out.open())
    ]
    assert rows == [
        ("attention", "300", "1 chunks", "False"),
        ("attention", "384", "2 chunks", "True"),
        ("rms_norm", "650", "written-out backward", "True"),
        ("train_pass", "650", "chunks", "True"),
        ("train_pass", "650", "norm_backward", "True"),
        ("train_pass", "650", "both", "True"),
        # 2 x 650 x 128 values: below the compiled kernels' threshold, so not compiled here
        ("train_pass", "650", "fused", "False"),
        ("train_pass", "650", "fused over both", "False"),
    ]
    assert "largest relative gradient difference" in res.stdout

"""``benchmarks/causal_chunks.py`` runs end to end (its train pass checks that the chunks give the
same log-probs) and writes one row per length and one for the train pass, each saying how many
chunks it ran and whether the trainer takes them there. Timing is not asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_script_runs_and_writes_its_csv(tmp_path):
    out = tmp_path / "chunks.csv"
    args = ["--repeats", "1", "--batch", "2", "--threads", "1", "--lengths", "300", "384"]
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "causal_chunks.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [(r["what"], r["length"], r["chunks"], r["applied"]) for r in csv.DictReader(out.open())]
    assert rows == [
        ("attention", "300", "1", "False"),
        ("attention", "384", "2", "True"),
        ("train_pass", "650", "3", "True"),
    ]
    assert "largest relative gradient difference" in res.stdout

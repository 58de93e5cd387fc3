"""``benchmarks/train_scored.py``: its episode marks exactly the replies as actions, and the script
runs end to end (checking that both passes agree) and writes its CSV. Timing is not asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.train_scored import episode_with_actions


def test_the_action_mask_covers_the_replies_and_nothing_else():
    from transformers import AutoTokenizer

    from earl_lightning.models.loading import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("earl-tiny"))
    ids, mask = episode_with_actions(tokenizer, turns=3, reply_len=8)
    actions = [t for t, m in zip(ids, mask) if m]
    assert len(actions) == 24 and tokenizer.decode(actions) == "7" * 24
    assert len(ids) == len(mask) and mask[0] == 0.0


def test_script_runs_and_writes_its_csv(tmp_path):
    out = tmp_path / "scored.csv"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "train_scored.py"),
            "--repeats",
            "2",
            "--batch",
            "3",
            "--turns",
            "3",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["what"]: float(r["value"]) for r in csv.DictReader(out.open())}
    assert rows["episodes"] == 3 and rows["scored_positions"] == 24
    assert rows["plain_seconds"] > 0 and rows["scored_seconds"] > 0
    assert rows["max_relative_grad_difference"] < 1e-4

"""``benchmarks/vs_trl_learning.py`` smoke-run: GRPO on the addition rows from one starting model by
earl_lightning and by TRL's GRPOTrainer, 1 step each in fresh processes, both evaluated by the same
function before and after it; the CSVs, the PNG and the verdict lines are written. Figures are not
asserted beyond sanity; the comparison's fairness rests on both sides taking the recipe's settings,
checked here."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl_learning import recipe_settings, time_to_reach  # noqa: E402


def test_both_sides_run_and_are_evaluated_alike(tmp_path):
    data = tmp_path / "data"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_addition.py"),
            "--out",
            str(data),
            "--train",
            "64",
            "--test",
            "8",
        ],
        check=True,
        capture_output=True,
    )
    from earl_lightning.models import resolve_model_path

    out = tmp_path / "res" / "learn"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "vs_trl_learning.py"),
        "--warm-starts",
        resolve_model_path("earl-tiny"),
        "--seeds",
        "0",
        "--train",
        str(data / "train.jsonl"),
        "--test",
        str(data / "test.jsonl"),
        "--steps",  # an evaluation before training and one after an update, on each side
        "1",
        "--eval-every",
        "1",
        "--eval-rows",
        "4",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with out.with_name("learn_points.csv").open() as f:
        points = list(csv.DictReader(f))
    assert sorted({(p["side"], p["step"]) for p in points}) == [
        (s, k) for s in ("earl", "trl") for k in "01"
    ]
    assert all(0.0 <= float(p["accuracy"]) <= 1.0 and float(p["train_s"]) >= 0.0 for p in points)
    assert out.with_suffix(".png").stat().st_size > 10_000 and out.with_suffix(".csv").is_file()
    assert (
        "final held-out accuracy: earl" in proc.stdout
        and "earl's time to TRL's final accuracy" in proc.stdout
    )


def test_the_sides_take_the_recipes_settings():
    s = recipe_settings(str(ROOT / "recipes" / "addition_grpo_warm.yaml"))
    assert s == {
        "lr": 3e-5,
        "kl": 0.0,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "batch": 64,
        "group": 8,
        "max_new_tokens": 24,
        "temperature": 1.0,
    }
    points = [
        {"train_s": 1.0, "accuracy": 0.1},
        {"train_s": 2.0, "accuracy": 0.5},
        {"train_s": 3.0, "accuracy": 0.4},
    ]
    assert time_to_reach(points, 0.45) == 2.0 and time_to_reach(points, 0.9) == float("inf")

"""scripts/compare_runs.py: two seeds.py outputs' TensorBoard logs -> one row per seed and run."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from tests.load import load_repo_file


def fake_run(root, accuracy, groups_drawn=None, weights=None):
    """A seeds.py seed directory: rl/ with a log (10 steps, 2 s apart; an evaluation every 5
    steps, 1 s after the step) and its config, and record.json."""
    rl = root / "rl" / "lightning_logs" / "version_0"
    with SummaryWriter(str(rl)) as w:
        for step in range(10):
            w.add_scalar("reward/mean", step / 10, step, walltime=100.0 + 2 * step)
            w.add_scalar("reward/zero_std_groups", 0.5 if step < 5 else 0.9, step, walltime=100.0)
            w.add_scalar("logprob/mismatch", 1e-6 * (step + 1), step, walltime=100.0)
            if groups_drawn is not None:
                w.add_scalar("dynamic_sampling/groups_drawn", groups_drawn[step], step, walltime=0)
                w.add_scalar("dynamic_sampling/groups_dropped", groups_drawn[step] - 8, step, 0)
            if weights is not None:
                w.add_scalar("rollout_correction/weight_min", weights[0], step, walltime=0)
                w.add_scalar("rollout_correction/weight_max", weights[1], step, walltime=0)
        for i, value in enumerate(accuracy):
            w.add_scalar("val/rewards/accuracy_reward", value, 5 * i, walltime=100.0 + 10 * i + 1)
    (rl / "config.yaml").write_text(yaml.safe_dump({"data": {"batch_size": 64, "group_size": 8}}))
    (root / "record.json").write_text(json.dumps({"rl_wall_s": 33.0}))


def test_rows_give_steps_seconds_and_episodes_to_the_threshold(tmp_path, monkeypatch):
    off, on = tmp_path / "off", tmp_path / "on"
    fake_run(off / "seed0", [0.1, 0.5, 0.96], weights=(0.99, 1.01))
    fake_run(on / "seed0", [0.1, 0.97, 0.98], groups_drawn=[8, 16, 24, 8, 8, 16, 8, 8, 8, 8])
    out = tmp_path / "rows.csv"
    compare = load_repo_file("scripts/compare_runs.py", "compare_runs")
    argv = ["compare", "--runs", f"off={off}", f"on={on}", "--seeds", "0", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--threshold", "0.95", "--last", "5"])
    compare.main()
    rows = {r["run"]: r for r in csv.DictReader(out.open())}
    assert (rows["off"]["steps_to_threshold"], rows["on"]["steps_to_threshold"]) == ("10", "5")
    assert (rows["off"]["seconds_to_threshold"], rows["on"]["seconds_to_threshold"]) == ("20", "10")
    # off: 10 steps of 64; on: the groups drawn in steps 0-4 (8+16+24+8+8 = 64 groups of 8)
    assert rows["off"]["episodes_to_threshold"] == "640"
    assert rows["on"]["episodes_to_threshold"] == "512"
    assert rows["on"]["ds_groups_dropped"] == "32.0" and rows["off"]["ds_groups_dropped"] == ""
    assert float(rows["off"]["weight_min"]) == pytest.approx(0.99)
    assert float(rows["off"]["mismatch_max"]) == pytest.approx(1e-5)
    assert float(rows["off"]["reward_last"]) == pytest.approx(0.7)
    assert float(rows["off"]["zero_std_first"]) == pytest.approx(0.5)
    assert float(rows["off"]["s_per_step"]) == pytest.approx(2.0)
    assert rows["on"]["rl_wall_s"] == "33.0"


def test_a_run_that_is_not_a_directory_is_a_clear_error(tmp_path, monkeypatch):
    compare = load_repo_file("scripts/compare_runs.py", "compare_runs")
    monkeypatch.setattr(sys, "argv", ["compare", "--runs", f"off{tmp_path}"])
    with pytest.raises(SystemExit, match=r"error: `--runs` '.*' is not LABEL=DIR"):
        compare.main()

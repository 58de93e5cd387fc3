"""scripts/plot_learning_curve.py: TensorBoard scalars -> PNG + CSV of the same numbers."""

from __future__ import annotations

import csv
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.load import load_repo_file


def test_scalars_become_a_png_and_a_csv_with_the_runs_title(tmp_path, monkeypatch, capsys):
    logdir = tmp_path / "version_0"
    with SummaryWriter(str(logdir)) as w:
        for step in range(5):
            w.add_scalar("reward/mean", 0.1 * step, step)
        for step, (win, inv) in enumerate([(0.6, 0.3), (0.9, 0.01)]):
            w.add_scalar("val/win_rate", win, 20 * step)
            w.add_scalar("val/invalid_rate", inv, 20 * step)
    (logdir / "hparams.yaml").write_text(
        "algorithm:\n  advantage: {name: gae}\n  loss: {name: ppo_clip}\nmodel: earl-tiny\n"
    )
    plot = load_repo_file("scripts/plot_learning_curve.py", "plot_learning_curve")
    assert plot.default_title(logdir) == "earl_lightning: gae + ppo_clip (earl-tiny)"
    out = tmp_path / "curve.png"
    monkeypatch.setattr(sys, "argv", ["plot", str(logdir), "--out", str(out)])
    plot.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    got = {(r["tag"], int(r["step"])): float(r["value"]) for r in rows}
    assert got[("val/win_rate", 20)] == pytest.approx(0.9) and got[
        ("reward/mean", 4)
    ] == pytest.approx(0.4)
    assert "val/invalid_rate 0:0.300 20:0.010" in capsys.readouterr().out


def test_a_directory_without_events_is_a_clear_error(tmp_path, monkeypatch):
    plot = load_repo_file("scripts/plot_learning_curve.py", "plot_learning_curve")
    monkeypatch.setattr(sys, "argv", ["plot", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"error: no TensorBoard event file in '.*'"):
        plot.main()

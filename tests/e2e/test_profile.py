"""`earl profile --config <recipe>`: a real (1-process, dp1xtp1) profile of the recipe's model over
every stage, saved as JSON + one heatmap per stage, that AdaptiveParallelism then loads; and the
command's errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from earl_lightning.cli import main
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.throughput import ProfileTable

RECIPE = Path(__file__).parents[2] / "recipes" / "connect4_grpo.yaml"


def small_recipe(tmp_path: Path) -> Path:
    cfg = yaml.safe_load(RECIPE.read_text())
    cfg["model"]["rollout"].update(max_context_tokens=128, sampling={"max_new_tokens": 2})
    cfg["model"]["optim"]["micro_batch_tokens"] = 512
    cfg["data"].update(batch_size=4, group_size=2)
    out = tmp_path / "small.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_profile_writes_table_and_heatmaps(tmp_path, capsys):
    out = tmp_path / "prof"
    main(
        [
            "profile",
            "--config",
            str(small_recipe(tmp_path)),
            "--out",
            str(out),
            "--budget-s",
            "60",
            "--contexts",
            "32",
            "96",
            "--repeats",
            "1",
        ]
    )
    table = ProfileTable.load(out / "profile.json", model="earl-tiny", world_size=1)
    assert table.stages() == ["rollout", "experience", "train"]
    for stage in table.stages():
        assert table.contexts(stage) == [32, 96] and table.num_seqs_buckets(stage) == [4]
        # one process: dp1xtp1 only; the train stage also with activation checkpointing
        assert table.layouts(stage) == ["dp1xtp1-mbt512"] + (
            ["dp1xtp1-mbt512-ckpt"] if stage == "train" else []
        )
        # the callback's other micro-batch variants resolve to the measured one
        assert table.lookup(stage, Layout(micro_batch_tokens=128), 64, 4) > 0
        assert (out / f"profile_{stage}.png").stat().st_size > 1000
    assert "measured 8 cells" in capsys.readouterr().out


def test_spent_budget_skips_cells_and_still_writes_a_valid_table(tmp_path, capsys):
    out = tmp_path / "prof"
    main(
        [
            "profile",
            "--config",
            str(small_recipe(tmp_path)),
            "--out",
            str(out),
            "--budget-s",
            "0.001",
            "--contexts",
            "32",
            "--repeats",
            "1",
        ]
    )
    # the warm-up alone spends 1 ms: every cell is skipped, and said so
    printed = capsys.readouterr().out
    assert "measured 0 cells" in printed and "(4 skipped by the budget)" in printed
    table = ProfileTable.load(out / "profile.json", world_size=1)
    assert len(table) == 0


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--config", "nope.yaml"], r"earl profile: error: `--config` 'nope.yaml' is not a file"),
        (
            ["--config", "{recipe}", "--budget-s", "-3"],
            r"earl profile: error: `budget_s` must be a positive number of "
            r"seconds or None, got -3.0",
        ),
        (
            ["--config", "{recipe}", "--contexts", "1"],
            r"earl profile: error: `contexts` must be a non-empty list of "
            r"integers >= 2, got \[1\]",
        ),
    ],
)
def test_profile_errors(tmp_path, capsys, argv, match):
    argv = [a.replace("{recipe}", str(small_recipe(tmp_path))) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(["profile", *argv])
    assert exc.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)

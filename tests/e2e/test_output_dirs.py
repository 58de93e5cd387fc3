"""No output directory costs data (issue 52, items 3 and 4). Every directory a command replaces when
it ends (`earl fit --export.dirpath`, `earl export --out`, `earl sft --output_dir`) is checked
before any work: not a file, empty unless asked to replace it (`--export.overwrite true`,
`--overwrite`), and never the checkpoint or model the command reads, nor the run's root, logs or
checkpoints, nor a directory that holds one of them, whatever the overwrite flag says; and
`--trainer.default_root_dir` is a directory. Each refusal is one line, exit 2, nothing touched.

One real 1-step fit gives the run (its trained model exported over a non-empty directory, asked
for) that the other tests copy or read."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from earl_lightning.cli import main
from earl_lightning.models import make_tiny_model
from tests.distributed.launch import subprocess_env
from tests.e2e.test_checkpoint_trust import dcp_saved
from tests.e2e.test_file_errors import (
    RECIPE,
    copy_run,
    error_line,
    fit,
    last_ckpt,
    recipe_saving_last_every_step,
    run_earl,
)
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
SFT = ROOT / "recipes" / "connect4_sft.yaml"
SFT_SMALL = [  # (were a check missing, the warm start a test would run)
    "--data.num_episodes",
    "4",
    "--data.eval_episodes",
    "2",
    "--data.batch_size",
    "4",
    "--trainer.max_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


def earl(*argv: str) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(Path(sys.executable).with_name("earl")), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        timeout=300,
    )


def holding(folder: Path, text: str = "mine") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text(text)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run root) of a 1-step fit whose model is exported over a non-empty directory
    (``--export.overwrite true``); its checkpoints in ``run/checkpoints``."""
    tmp = tmp_path_factory.mktemp("trained")
    recipe = recipe_saving_last_every_step(tmp)
    out = holding(tmp / "exported")
    with pytest.MonkeyPatch.context() as patch:  # (conftest's argv fixture is per test)
        patch.setattr(sys, "argv", ["earl"])
        main(
            fit(recipe, tmp / "run", 1, "--export.dirpath", str(out), "--export.overwrite", "true")
        )
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()
    return recipe, tmp / "run"


# ---- earl fit --export.dirpath -------------------------------------------------------------------


def test_a_non_empty_export_dirpath_is_refused_before_training(tmp_path, capsys):
    out = holding(tmp_path / "mine")
    code, err = run_earl(capsys, fit(RECIPE, tmp_path / "run", 1, "--export.dirpath", str(out)))
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--export.dirpath` '{out}' exists and is not empty; pass --export.overwrite "
        "true to replace it, or choose another directory"
    )
    assert (out / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "run").exists()  # nothing trained, nothing logged


def test_an_export_dirpath_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "model"
    out.write_text("mine")
    argv = fit(
        RECIPE, tmp_path / "run", 1, "--export.dirpath", str(out), "--export.overwrite", "true"
    )
    code, err = run_earl(capsys, argv)
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--export.dirpath` '{out}' is a file; it must be a directory (new, empty, or "
        "with --export.overwrite true)"
    )
    assert out.read_text() == "mine"


@pytest.mark.parametrize("target", ["root", "checkpoints", "parent"])
def test_an_export_dirpath_holding_the_runs_checkpoints_is_refused(
    trained, tmp_path, capsys, target
):
    """Resuming the run with the model exported over its root, its checkpoint directory, or a
    directory holding both: refused even with --export.overwrite true (replacing it would delete
    the run's checkpoints and the one it resumes from)."""
    recipe, root = copy_run(trained, tmp_path)
    last = last_ckpt(root)
    out = {"root": root, "checkpoints": last.parent, "parent": tmp_path}[target]
    what = {
        "root": f"is the run's root (`--trainer.default_root_dir` '{root}')",
        "checkpoints": f"is the run's checkpoints ('{last.parent}')",
        "parent": f"contains the run's root (`--trainer.default_root_dir` '{root}')",
    }[target]
    argv = fit(
        recipe,
        root,
        2,
        "--ckpt_path",
        "last",
        "--export.dirpath",
        str(out),
        "--export.overwrite",
        "true",
    )
    code, err = run_earl(capsys, argv)
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--export.dirpath` '{out}' {what}; writing it replaces the whole directory: "
        "choose another"
    )
    assert last.is_file()
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


def test_an_export_dirpath_holding_the_checkpoint_read_is_refused(trained, tmp_path, capsys):
    """A new run (its own root) resuming another run's checkpoint, exporting over that run."""
    _, old = copy_run(trained, tmp_path)
    last = last_ckpt(old)
    (tmp_path / "new").mkdir()
    argv = fit(
        recipe_saving_last_every_step(tmp_path / "new"),
        tmp_path / "new" / "run",
        2,
        "--ckpt_path",
        str(last),
        "--export.dirpath",
        str(old),
        "--export.overwrite",
        "true",
    )
    code, err = run_earl(capsys, argv)
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--export.dirpath` '{old}' contains the checkpoint the run reads ('{last}'); "
        "writing it replaces the whole directory: choose another"
    )
    assert last.is_file()


def test_a_default_root_dir_that_is_a_file_is_refused(tmp_path, capsys):
    root = tmp_path / "run"
    root.write_text("mine")
    code, err = run_earl(capsys, fit(RECIPE, root, 1))
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--trainer.default_root_dir` '{root}' is a file; it must be a directory (the "
        "run's logs and checkpoints)"
    )
    assert root.read_text() == "mine"


def test_a_default_root_dir_inside_the_checkpoint_read_is_refused(tmp_path, capsys):
    """A distributed checkpoint's directory is the checkpoint: a run's logs go elsewhere."""
    ckpt = dcp_saved(tmp_path / "last.ckpt")
    code, err = run_earl(capsys, fit(RECIPE, ckpt / "run", 1, "--ckpt_path", str(ckpt)))
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--trainer.default_root_dir` '{ckpt / 'run'}' is inside the checkpoint the "
        f"run reads (`--ckpt_path` '{ckpt}'): choose a directory outside it"
    )
    assert not (ckpt / "run").exists()


# ---- earl export --out ---------------------------------------------------------------------------


def test_export_refuses_to_write_over_its_own_checkpoint(trained, tmp_path):
    _, root = copy_run(trained, tmp_path)
    last = last_ckpt(root)
    proc = earl("export", "--ckpt_path", str(last), "--out", str(last.parent), "--overwrite")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"earl: error: `--out` '{last.parent}' contains the checkpoint read (`--ckpt_path` "
        f"'{last}'); writing it replaces the whole directory: choose another"
    )
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


def test_export_refuses_to_write_over_the_model_it_reads(trained, tmp_path, capsys):
    model = Path(shutil.copytree(make_tiny_model("earl-tiny"), tmp_path / "base"))
    files = sorted(p.name for p in model.iterdir())
    argv = ["export", "--ckpt_path", str(last_ckpt(trained[1])), "--out", str(model)]
    code, err = run_earl(capsys, [*argv, "--model", str(model), "--overwrite"])
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--out` '{model}' is the model read (`--model`); writing it replaces the "
        "whole directory: choose another"
    )
    assert sorted(p.name for p in model.iterdir()) == files


def test_export_refuses_to_write_inside_the_checkpoint_it_reads(tmp_path, capsys):
    ckpt = dcp_saved(tmp_path / "last.ckpt")
    argv = ["export", "--ckpt_path", str(ckpt), "--out", str(ckpt / "model")]
    code, err = run_earl(capsys, argv)
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--out` '{ckpt / 'model'}' is inside the checkpoint read (`--ckpt_path` "
        f"'{ckpt}'): choose a directory outside it"
    )
    assert not (ckpt / "model").exists()


# ---- earl sft --output_dir ------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["root", "parent"])
def test_sft_output_dir_holding_its_own_logs_is_refused(tmp_path, capsys, target):
    root = holding(tmp_path / "runs" / "sft")
    out = {"root": root, "parent": tmp_path / "runs"}[target]
    relation = {"root": "is", "parent": "contains"}[target]
    argv = ["sft", "--config", str(SFT), "--output_dir", str(out), "--overwrite", *SFT_SMALL]
    code, err = run_earl(capsys, [*argv, "--trainer.default_root_dir", str(root)])
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--output_dir` '{out}' {relation} the run's root (`--trainer.default_root_dir` "
        f"'{root}'); writing it replaces the whole directory: choose another"
    )
    assert (root / "notes.txt").read_text() == "mine"


def test_sft_default_root_dir_that_is_a_file_is_refused(tmp_path, capsys):
    root = tmp_path / "logs"
    root.write_text("mine")
    argv = ["sft", "--config", str(SFT), "--output_dir", str(tmp_path / "m"), *SFT_SMALL]
    code, err = run_earl(capsys, [*argv, "--trainer.default_root_dir", str(root)])
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--trainer.default_root_dir` '{root}' is a file; it must be a directory "
        "(the run's logs)"
    )


def test_sft_output_dir_holding_the_model_it_reads_is_refused(tmp_path, capsys):
    model = Path(shutil.copytree(make_tiny_model("earl-tiny-4l"), tmp_path / "models" / "base"))
    out = tmp_path / "models"
    argv = ["sft", "--config", str(SFT), "--output_dir", str(out), "--overwrite", *SFT_SMALL]
    code, err = run_earl(
        capsys,
        [
            *argv,
            *SFT_SMALL,
            "--model.model",
            str(model),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ],
    )
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--output_dir` '{out}' contains the model read (`--model.model` '{model}'); "
        "writing it replaces the whole directory: choose another"
    )
    assert (model / "config.json").is_file()


def test_an_export_dirpath_holding_checkpoints_found_later_is_never_replaced(tmp_path, capsys):
    """The logger's version directory, where the default checkpoints go: unknown when the fit
    starts, so checked again before the model is written (with --export.overwrite true: without,
    the config saved there makes it non-empty at the start); the run's checkpoint stays."""
    version = tmp_path / "run" / "lightning_logs" / "version_0"
    argv = fit(RECIPE, tmp_path / "run", 1, "--export.dirpath", str(version))
    code, err = run_earl(capsys, [*argv, "--export.overwrite", "true"])
    assert code == 1
    assert error_line(err) == (
        f"earl: error: the trained model was not exported: `--export.dirpath` '{version}' contains "
        f"the run's checkpoints ('{version / 'checkpoints'}'); writing it replaces the whole "
        "directory: choose another"
    )
    assert [p.name for p in (version / "checkpoints").iterdir()] == ["last.ckpt"]

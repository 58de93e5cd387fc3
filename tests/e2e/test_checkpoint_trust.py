"""A checkpoint runs no code and a kill costs no save (issue 45): a planted DCP ``.metadata`` pickle
is refused by every reader before it runs; ``--ckpt_path last`` looks only where the run writes and
finds the checkpoint a crash between the two renames of a replacement left; a save killed mid-write
leaves no checkpoint-sized temporary behind once the next save runs."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from earl_lightning.checkpoints.files import (
    check_before_load,
    newest_last_checkpoint,
    read_dcp_metadata,
    read_dcp_shapes,
    save_file_atomically,
)
from earl_lightning.cli import main
from earl_lightning.core.errors import CheckpointError
from earl_lightning.modules.rl import AgenticRLModule
from tests.distributed.launch import subprocess_env
from tests.e2e.test_file_errors import (
    RECIPE,
    error_line,
    fit,
    recipe_saving_last_every_step,
    run_earl,
)
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(ckpt: Path, marker: Path) -> Path:
    """A directory that looks like a DCP checkpoint whose ``.metadata`` runs ``touch marker`` when unpickled."""
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    for rank in range(2):
        (ckpt / f"__{rank}_0.distcp").write_bytes(b"\0" * 16)
    torch.save({"global_step": 1}, ckpt / "meta.pt")
    return ckpt


def refused(ckpt: Path) -> str:
    return (
        f"checkpoint '{ckpt}': its .metadata holds posix.system, a type a checkpoint does not (the file was "
        "not written by a save); refused without running it"
    )


def dcp_saved(path: Path) -> Path:
    """A real DCP checkpoint directory, written by this one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {
                "state_dict": {"w": torch.ones(3, 4, dtype=torch.bfloat16)},
                "step": 3,
                "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            },
            checkpoint_id=str(path),
        )
    torch.save({"global_step": 3}, path / "meta.pt")
    return path


# ---- a planted .metadata --------------------------------------------------------------------------


def test_a_real_dcp_metadata_is_read(tmp_path):
    ckpt = dcp_saved(tmp_path / "last.ckpt")
    assert read_dcp_shapes(ckpt) == {"w": (3, 4)}
    assert "state_dict.w" in read_dcp_metadata(ckpt).state_dict_metadata


def test_a_planted_metadata_is_refused_by_every_reader(tmp_path):
    """read_dcp_shapes is what EarlStrategy's load and `earl export` call before torch reads the file."""
    marker = tmp_path / "ran"
    ckpt = plant(tmp_path / "last.ckpt", marker)
    for read in (
        read_dcp_metadata,
        read_dcp_shapes,
        lambda p: check_before_load(p, one_process=False, expected={}, strict=False),
    ):
        with pytest.raises(CheckpointError) as err:
            read(ckpt)
        assert str(err.value) == refused(ckpt)
    assert not marker.exists()


def test_a_metadata_that_is_not_metadata_is_refused(tmp_path):
    ckpt = dcp_saved(tmp_path / "last.ckpt")
    (ckpt / ".metadata").write_bytes(pickle.dumps({"a": [1, 2]}))
    with pytest.raises(
        CheckpointError, match=r"its \.metadata holds a dict, not a checkpoint's metadata; refused"
    ):
        read_dcp_metadata(ckpt)


def earl(*argv: str) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(Path(sys.executable).with_name("earl")), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        timeout=300,
    )


def test_export_refuses_a_planted_checkpoint(tmp_path):
    marker = tmp_path / "ran"
    ckpt = plant(tmp_path / "last.ckpt", marker)
    proc = earl("export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == f"earl: error: `--ckpt_path`: {refused(ckpt)}", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_fit_refuses_a_planted_checkpoint_named_on_the_command_line(tmp_path, capsys):
    marker = tmp_path / "ran"
    ckpt = plant(tmp_path / "last.ckpt", marker)
    argv = fit(RECIPE, tmp_path / "run", 1, "--trainer.strategy", "earl", "--ckpt_path", str(ckpt))
    code, err = run_earl(capsys, argv)
    assert code == 2
    assert error_line(err) == f"earl: error: `--ckpt_path`: {refused(ckpt)}"
    assert not marker.exists()


def test_ckpt_path_last_refuses_a_planted_checkpoint_where_the_run_writes(tmp_path, capsys):
    marker = tmp_path / "ran"
    recipe = recipe_saving_last_every_step(tmp_path)
    ckpt = plant(tmp_path / "run" / "checkpoints" / "last.ckpt", marker)
    code, err = run_earl(
        capsys,
        fit(recipe, tmp_path / "run", 1, "--trainer.strategy", "earl", "--ckpt_path", "last"),
    )
    assert code == 1
    assert error_line(err) == f"earl: error: {refused(ckpt)}"
    assert not marker.exists()


# ---- --ckpt_path last --------------------------------------------------------------------------------


@pytest.fixture
def starts(monkeypatch) -> list[int]:
    """The global step each fit of this test starts at."""
    seen, real = [], AgenticRLModule.on_train_start

    def on_train_start(self) -> None:
        seen.append(self.trainer.global_step)
        real(self)

    monkeypatch.setattr(AgenticRLModule, "on_train_start", on_train_start)
    return seen


def test_ckpt_path_last_ignores_checkpoints_the_run_does_not_write(tmp_path, capsys, starts):
    """A `last.ckpt` planted elsewhere under the run's root is no candidate: never read, never run."""
    marker = tmp_path / "ran"
    recipe = recipe_saving_last_every_step(tmp_path)
    plant(tmp_path / "run" / "elsewhere" / "last.ckpt", marker)
    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 1, "--trainer.strategy", "earl", "--ckpt_path", "last"))
    err = capsys.readouterr().err
    assert (
        f"earl: no checkpoint named last*.ckpt under '{tmp_path / 'run'}': starting from the beginning"
        in err
    )
    assert starts == [0] and not marker.exists()
    assert (
        torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        == 1
    )


def test_ckpt_path_last_resumes_from_what_a_crash_between_the_renames_left(
    tmp_path, capsys, starts
):
    """The state a kill between replace_dir's two renames leaves: only `.last.ckpt.old`. The run
    resumes from it (step 1), says so in one line, and does not start over at step 0."""
    recipe = recipe_saving_last_every_step(tmp_path)
    main(fit(recipe, tmp_path / "run", 1, "--trainer.strategy", "earl"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    old = last.with_name(".last.ckpt.old")
    os.replace(last, old)
    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "earl", "--ckpt_path", "last"))
    err = capsys.readouterr().err
    assert (
        f"earl: the save that replaced '{last}' was interrupted; resuming from the previous checkpoint, "
        f"'{old}'"
    ) in err.splitlines(), err[-3000:]
    assert starts == [0, 1]
    assert torch.load(last, weights_only=True)["global_step"] == 2


REPLACE_AND_DIE = """
import os, sys, time
from earl_lightning.cli import main
from earl_lightning.checkpoints.files import replace_dir
real = os.replace
def replace(src, dst):
    real(src, dst)
    print("renamed", flush=True)
    time.sleep(600)  # killed here: between the two renames
os.replace = replace
replace_dir(sys.argv[1], sys.argv[2])
"""


def test_a_kill_between_the_renames_leaves_the_previous_checkpoint_found(tmp_path):
    folder = tmp_path / "checkpoints"
    last = dcp_saved(folder / "last.ckpt")
    new = dcp_saved(folder / ".last.ckpt.partial")
    proc = subprocess.Popen(
        [sys.executable, "-c", REPLACE_AND_DIE, str(new), str(last)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
    )
    assert proc.stdout.readline() == "renamed\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not last.exists()
    found = newest_last_checkpoint([folder])
    assert found == folder / ".last.ckpt.old"
    assert read_dcp_shapes(found) == {"w": (3, 4)}


# ---- a save killed mid-write ----------------------------------------------------------------------

SAVE_AND_DIE = """
import os, sys, time, torch
from earl_lightning.cli import main
from earl_lightning.checkpoints.files import save_file_atomically
save_file_atomically({"step": 1}, sys.argv[1])
real = os.replace
def replace(src, dst):
    print("written", flush=True)
    time.sleep(600)  # killed here: the temporary file is whole, not yet renamed
os.replace = replace
save_file_atomically({"step": 2, "w": torch.ones(1_000_000)}, sys.argv[1])
"""


def test_a_killed_save_leaves_no_temporary_after_the_next_save(tmp_path):
    path = tmp_path / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVE_AND_DIE, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
    )
    assert proc.stdout.readline() == "written\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = path.with_name(f".last.ckpt.partial{proc.pid}")
    assert stale.stat().st_size > 4_000_000  # checkpoint-sized
    assert torch.load(path, weights_only=True) == {"step": 1}  # the previous save is whole
    live = subprocess.Popen(["sleep", "60"])
    in_progress = path.with_name(f".last.ckpt.partial{live.pid}")
    in_progress.write_bytes(b"a live process's save")
    try:
        save_file_atomically({"step": 3}, path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [in_progress.name, "last.ckpt"]
    finally:
        live.kill()
        live.wait()
    assert torch.load(path, weights_only=True) == {"step": 3}

"""Resuming and saving under any strategy (issue 45): a save killed under ``strategy: auto`` keeps
the previous checkpoint, which ``--ckpt_path last`` resumes from; a distributed (DCP) checkpoint
directory resumes under a strategy that reads single files (loaded whole), or, under a recipe's own
CheckpointIO, is one line saying what to do; a checkpoint's saved hyperparameters never replace the
config's (model path, import paths), a difference is one line."""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from earl_lightning.checkpoints.files import dcp_writers
from earl_lightning.cli import main
from earl_lightning.modules.rl import AgenticRLModule
from tests.distributed.launch import subprocess_env
from tests.e2e.test_checkpoint_trust import dcp_saved, starts  # noqa: F401 - starts: a fixture
from tests.e2e.test_file_errors import (
    RECIPE,
    earl_subprocess,
    error_line,
    fit,
    recipe_saving_last_every_step,
    run_earl,
)

ROOT = Path(__file__).parents[2]

# `earl fit ARGV` whose second checkpoint save stops, its file whole beside `last.ckpt`, before
# the rename that would make it `last.ckpt`: the test kills it there.
SECOND_SAVE_HANGS = """
import os, sys, time
from earl_lightning.cli import main
real, saves = os.replace, []
def replace(src, dst):
    if ".partial" in os.fspath(src):
        saves.append(src)
        if len(saves) == 2:
            print("written", flush=True)
            time.sleep(600)
    return real(src, dst)
os.replace = replace
main(sys.argv[1:])
"""


def test_a_save_killed_under_strategy_auto_keeps_the_last_checkpoint(tmp_path, capsys, starts):  # noqa: F811
    recipe = recipe_saving_last_every_step(tmp_path)
    argv = fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto")
    proc = subprocess.Popen(
        [sys.executable, "-c", SECOND_SAVE_HANGS, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
    )
    try:
        lines = iter(proc.stdout.readline, "")
        assert "written\n" in lines, proc.stderr.read()[
            -3000:
        ]  # the step-2 save is written, not renamed
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close(), proc.stderr.close()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    stale = last.with_name(f".last.ckpt.partial{proc.pid}")
    # the killed save: a checkpoint-sized file beside last.ckpt
    assert stale.stat().st_size > 100_000
    assert torch.load(last, weights_only=True)["global_step"] == 1  # step 1's checkpoint, whole

    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto", "--ckpt_path", "last"))
    # the same recipe: nothing to report
    assert "saved with other settings" not in capsys.readouterr().err
    assert starts == [1]  # resumed from step 1, not started over
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # the stale file removed


# ---- a DCP directory under a strategy that reads single files --------------------------------------


@pytest.fixture
def at_train_start(monkeypatch) -> dict:
    """What the module and its optimizer hold when training starts (after a resume's load)."""
    seen: dict = {}
    real = AgenticRLModule.on_train_start

    def on_train_start(self) -> None:
        names = {id(p): n for n, p in self.named_parameters()}
        optimizer = self.trainer.optimizers[0]
        seen.update(
            step=self.trainer.global_step,
            state={k: v.clone() for k, v in self.state_dict().items()},
            optimizer=copy.deepcopy(optimizer.state_dict()),
            names=[names[id(p)] for g in optimizer.param_groups for p in g["params"]],
        )
        real(self)

    monkeypatch.setattr(AgenticRLModule, "on_train_start", on_train_start)
    return seen


def test_a_dcp_checkpoint_of_two_processes_resumes_under_strategy_auto(
    tmp_path, capsys, at_train_start
):
    """A 2-process EarlStrategy run's DCP `last.ckpt`, resumed by `--ckpt_path last` under strategy
    auto on one process: one line says so, the weights and Adam's state are the checkpoint's
    (torch's own DCP-to-file conversion is the reference), and the next save replaces the
    directory with a file."""
    recipe = recipe_saving_last_every_step(tmp_path)
    proc = earl_subprocess(
        *fit(recipe, tmp_path / "run", 1, "--trainer.devices", "2", "--trainer.strategy", "earl")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert (last / ".metadata").is_file() and dcp_writers(last) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(last, tmp_path / "reference.pt")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)

    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto", "--ckpt_path", "last"))
    err = capsys.readouterr().err
    assert (
        f"earl: `--ckpt_path` '{last}' is a distributed (DCP) checkpoint of 2 processes; this run (1 process, "
        "not under EarlStrategy) loads its tensors whole"
    ) in err.splitlines(), err[-3000:]
    assert at_train_start["step"] == 1
    for key, value in reference["state_dict"].items():
        assert torch.equal(at_train_start["state"][key], value), key
    saved_optimizer = reference["optimizer_0"]
    assert at_train_start["names"] == [
        n for g in saved_optimizer["param_groups"] for n in g["params"]
    ]
    for index, name in enumerate(at_train_start["names"]):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                at_train_start["optimizer"]["state"][index][moment],
                saved_optimizer["state"][name][moment],
            ), (name, moment)
    assert torch.load(last, weights_only=True)["global_step"] == 2  # a file now
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


def test_a_dcp_directory_under_a_recipes_own_checkpoint_io_is_one_line(tmp_path, capsys):
    ckpt = dcp_saved(tmp_path / "saved" / "last.ckpt")
    code, err = run_earl(
        capsys,
        fit(
            RECIPE,
            tmp_path / "run",
            1,
            "--trainer.strategy",
            "auto",
            "--trainer.plugins",
            "lightning.pytorch.plugins.TorchCheckpointIO",
            "--ckpt_path",
            str(ckpt),
        ),
    )
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--ckpt_path`: checkpoint '{ckpt}' is a distributed (DCP) checkpoint directory, saved by 1 "
        "process under EarlStrategy; this run's strategy (auto) reads single-file checkpoints only: resume it with "
        f"`--trainer.strategy earl --trainer.devices 2`, or take its model with `earl export --ckpt_path {ckpt} "
        "--out DIR`"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing saved


# ---- a checkpoint's saved hyperparameters ----------------------------------------------------------


def test_the_config_wins_over_a_checkpoints_saved_model_and_import_paths(tmp_path, capsys):
    """A checkpoint whose saved hyperparameters name another model path, a loss and an env by import
    path: the resumed run uses the config's, and says in one line where they differ."""
    recipe = recipe_saving_last_every_step(tmp_path)
    main(fit(recipe, tmp_path / "run", 1, "--trainer.strategy", "auto"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    planted = "tests.plugins.algorithms.centered_reinforce_loss"
    state["hyper_parameters"]["model"] = str(tmp_path / "nowhere")
    state["hyper_parameters"]["algorithm"]["loss"]["name"] = planted
    state["datamodule_hyper_parameters"]["env"] = "tests.plugins.faulty_envs.RaisesInReset"
    torch.save(state, last)

    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto", "--ckpt_path", str(last)))
    err = capsys.readouterr().err
    assert (
        f"earl: `--ckpt_path` '{last}' was saved with other settings; this run uses its config's: "
        f"`--model.model` 'earl-tiny' (saved: '{tmp_path / 'nowhere'}'), `--model.algorithm.loss.name` "
        f"'ppo_clip' (saved: '{planted}'), `--data.env` 'connect_four' (saved: "
        "'tests.plugins.faulty_envs.RaisesInReset')"
    ) in err.splitlines(), err[-3000:]
    resumed = torch.load(last, weights_only=True)
    assert resumed["global_step"] == 2
    assert resumed["hyper_parameters"]["model"] == "earl-tiny"
    assert resumed["hyper_parameters"]["algorithm"]["loss"]["name"] == "ppo_clip"
    assert resumed["datamodule_hyper_parameters"]["env"] == "connect_four"

"""Resuming and saving under any strategy (issue 45): a save killed under ``strategy: auto`` keeps
the previous checkpoint, which ``--ckpt_path last`` resumes from; a distributed (DCP) checkpoint
directory given to a run that reads single files is one line saying what to do; a checkpoint's
saved hyperparameters never replace the config's (model path, import paths), a difference is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from earl_lightning.cli import main
from tests.distributed.launch import subprocess_env
from tests.e2e.test_checkpoint_trust import dcp_saved, starts  # noqa: F401 - starts: a fixture
from tests.e2e.test_file_errors import RECIPE, error_line, fit, recipe_saving_last_every_step, run_earl

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
    proc = subprocess.Popen([sys.executable, "-c", SECOND_SAVE_HANGS, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(PYTHONPATH=str(ROOT)))
    try:
        lines = iter(proc.stdout.readline, "")
        assert "written\n" in lines, proc.stderr.read()[-3000:]  # the step-2 save is written, not renamed
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close(), proc.stderr.close()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    stale = last.with_name(f".last.ckpt.partial{proc.pid}")
    assert stale.stat().st_size > 100_000  # the killed save: a checkpoint-sized file beside last.ckpt
    assert torch.load(last, weights_only=True)["global_step"] == 1  # step 1's checkpoint, whole

    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto", "--ckpt_path", "last"))
    assert "saved with other settings" not in capsys.readouterr().err  # the same recipe: nothing to report
    assert starts == [1]  # resumed from step 1, not started over
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # the stale file removed


# ---- a DCP directory under a strategy that reads single files --------------------------------------

def dcp_line(ckpt: Path) -> str:
    return (f"earl: error: `--ckpt_path`: checkpoint '{ckpt}' is a distributed (DCP) checkpoint directory, saved by "
            "1 process under EarlStrategy; this run's strategy (auto) reads single-file checkpoints only: resume it "
            f"with `--trainer.strategy earl --trainer.devices 2`, or take its model with `earl export --ckpt_path "
            f"{ckpt} --out DIR`")


def test_a_dcp_directory_under_strategy_auto_is_one_line(tmp_path, capsys):
    ckpt = dcp_saved(tmp_path / "saved" / "last.ckpt")
    code, err = run_earl(capsys, fit(RECIPE, tmp_path / "run", 1, "--trainer.strategy", "auto",
                                     "--ckpt_path", str(ckpt)))
    assert code == 2
    assert error_line(err) == dcp_line(ckpt)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing saved


def test_ckpt_path_last_finding_a_dcp_directory_under_strategy_auto_is_one_line(tmp_path, capsys):
    recipe = recipe_saving_last_every_step(tmp_path)
    ckpt = dcp_saved(tmp_path / "run" / "checkpoints" / "last.ckpt")
    code, err = run_earl(capsys, fit(recipe, tmp_path / "run", 1, "--trainer.strategy", "auto", "--ckpt_path", "last"))
    assert code == 2
    assert error_line(err) == dcp_line(ckpt)
    assert (ckpt / ".metadata").is_file()  # left as it was


# ---- a checkpoint's saved hyperparameters ----------------------------------------------------------

def test_the_config_wins_over_a_checkpoints_saved_model_and_import_paths(tmp_path, capsys):
    """A checkpoint whose saved hyperparameters name another model path and a loss by import path:
    the resumed run uses the config's model and loss, and says in one line where they differ."""
    recipe = recipe_saving_last_every_step(tmp_path)
    main(fit(recipe, tmp_path / "run", 1, "--trainer.strategy", "auto"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    planted = "tests.plugins.algorithms.centered_reinforce_loss"
    state["hyper_parameters"]["model"] = str(tmp_path / "nowhere")
    state["hyper_parameters"]["algorithm"]["loss"]["name"] = planted
    torch.save(state, last)

    capsys.readouterr()
    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto", "--ckpt_path", str(last)))
    err = capsys.readouterr().err
    assert (f"earl: `--ckpt_path` '{last}' was saved with other settings; this run uses its config's: "
            f"`--model.model` 'earl-tiny' (saved: '{tmp_path / 'nowhere'}'), `--model.algorithm.loss.name` "
            f"'ppo_clip' (saved: '{planted}')") in err.splitlines(), err[-3000:]
    resumed = torch.load(last, weights_only=True)
    assert resumed["global_step"] == 2
    assert resumed["hyper_parameters"]["model"] == "earl-tiny"
    assert resumed["hyper_parameters"]["algorithm"]["loss"]["name"] == "ppo_clip"

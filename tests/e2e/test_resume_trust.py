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
from tests.e2e.test_checkpoint_trust import starts  # noqa: F401 - a fixture
from tests.e2e.test_file_errors import fit, recipe_saving_last_every_step

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

    main(fit(recipe, tmp_path / "run", 2, "--trainer.strategy", "auto", "--ckpt_path", "last"))
    assert starts == [1]  # resumed from step 1, not started over
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # the stale file removed

"""The Connect Four recipes on 2 gloo processes under EarlStrategy, through the `earl` command: the
default (actor-critic: value head, one row per turn, allowed tokens) and the GRPO one."""

import subprocess
import sys
from pathlib import Path

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.distributed.launch import subprocess_env

RECIPES = Path(__file__).parents[2] / "recipes"


def scalars(root: Path) -> dict[str, list[float]]:
    ev = next(root.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(ev.parent)); acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.mark.parametrize("name", ["connect4_ppo", "connect4_grpo"])
def test_recipe_on_two_processes_with_earl_strategy(tmp_path, name):
    earl = Path(sys.executable).with_name("earl")
    cmd = [str(earl), "fit", "--config", str(RECIPES / f"{name}.yaml"), "--trainer.devices", "2", "--trainer.strategy", "earl",
           "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.default_root_dir",
           str(tmp_path), "--trainer.enable_progress_bar", "false", "--data.batch_size", "16",
           "--data.eval_episodes", "8"]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = scalars(tmp_path)
    assert s["layout/train/dp"] == [2.0, 2.0] and s["layout/rollout/tp"] == [1.0, 1.0]
    assert len(s["reward/mean"]) == 2 and "val/win_rate" in s
    assert max(s["logprob/mismatch"]) < 1e-4
    assert s["grad_norm"][0] > 0  # the dp ranks trained on their shards (gradients summed by FSDP)
    for tag in ("dispatch/bytes", "dispatch/seconds", "dispatch/imbalance", "reshard/bytes"):
        assert tag in s, tag

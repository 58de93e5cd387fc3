"""The Connect Four recipes on 2 gloo processes under EarlStrategy, through the `earl` command: the
default (actor-critic: value head, one row per turn, allowed tokens) and the GRPO one."""

import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

RECIPES = Path(__file__).parents[2] / "recipes"


def scalars(root: Path) -> dict[str, list[float]]:
    ev = next(root.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(ev.parent))
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def two_process_recipe(tmp_path: Path, env: str, env_kwargs: dict, allowed: str) -> Path:
    """A 2-step GRPO recipe of earl-tiny on 2 CPU processes, one-token actions from ``allowed``, run
    directory ``tmp_path / "run"``; written to ``tmp_path / "recipe.yaml"``."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "seed_everything": 0,
                "trainer": {
                    "accelerator": "cpu",
                    "devices": 2,
                    "max_steps": 2,
                    "val_check_interval": 2,
                    "check_val_every_n_epoch": None,
                    "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1,
                    "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path / "run"),
                },
                "model": {
                    "model": "earl-tiny",
                    "transcripts": {"every_n_steps": 0},
                    "rollout": {
                        "max_turns": 3,
                        "max_context_tokens": 512,
                        "sampling": {"max_new_tokens": 1, "allowed_tokens": list(allowed)},
                    },
                    "algorithm": {"advantage": {"name": "grpo"}},
                },
                "data": {
                    "env": env,
                    "env_kwargs": env_kwargs,
                    "batch_size": 16,
                    "group_size": 4,
                    "eval_episodes": 8,
                },
            }
        )
    )
    return recipe


@pytest.mark.parametrize("name", ["connect4_ppo", "connect4_grpo"])
def test_recipe_on_two_processes_with_earl_strategy(tmp_path, name):
    earl = Path(sys.executable).with_name("earl")
    cmd = [
        str(earl),
        "fit",
        "--config",
        str(RECIPES / f"{name}.yaml"),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "earl",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
        "--data.batch_size",
        "16",
        "--data.eval_episodes",
        "8",
    ]
    proc = run_earl_process(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = scalars(tmp_path)
    assert s["layout/train/dp"] == [2.0, 2.0] and s["layout/rollout/tp"] == [1.0, 1.0]
    assert len(s["reward/mean"]) == 2 and "val/win_rate" in s
    assert max(s["logprob/mismatch"]) < 1e-4
    assert s["grad_norm"][0] > 0  # the dp ranks trained on their shards (gradients summed by FSDP)
    assert len(s["reward/zero_std_groups"]) == 2 and all(
        0.0 <= v <= 1.0 for v in s["reward/zero_std_groups"]
    )
    for tag in ("dispatch/bytes", "dispatch/seconds", "dispatch/imbalance", "reshard/bytes"):
        assert tag in s, tag
    # torchmetrics synchronize the run's metrics: Lightning has no epoch-level metric to warn about
    assert "sync_dist" not in proc.stderr, proc.stderr[-4000:]


def test_env_by_import_path_on_two_processes(tmp_path):
    """A user's environment, defined in a test module and named by import path in the recipe, under
    a plain (DDP-free) Lightning strategy on 2 processes: every rank builds it from the path, the
    data-parallel stage context stands in, and the run trains and evaluates."""
    recipe = two_process_recipe(
        tmp_path,
        "tests.plugins.envs.GuessGame",
        {"low": 1, "high": 9, "max_guesses": 3},
        allowed="123456789",
    )
    earl = Path(sys.executable).with_name("earl")
    root = str(Path(__file__).parents[2])  # where `tests.plugins` is importable from
    proc = run_earl_process(
        [str(earl), "fit", "--config", str(recipe)],
        env=subprocess_env(PYTHONPATH=root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = scalars(tmp_path / "run")
    assert len(s["reward/mean"]) == 2 and len(s["val/win_rate"]) >= 1
    for rate in s["env/win_rate"] + s["env/invalid_rate"]:  # over the 16 episodes of both ranks
        # (tests/distributed/test_collectives.py: exactly)
        assert abs(rate * 16 - round(rate * 16)) < 1e-5
    assert "sync_dist" not in proc.stderr, proc.stderr[-4000:]

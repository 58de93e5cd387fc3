"""Every registered advantage estimator x policy loss, selected from YAML, fits 2 RL steps through the
`earl` CLI; so do a user's own loss and estimator named by import path (on a user's env, also by
import path). Each run must log finite
losses, a nonzero gradient, and the statistics its choice implies (a value loss for ``gae``, the
dual-clip fraction for the dual clip)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from earl_lightning.cli import main
from tests.e2e.test_multiprocess import scalars

ESTIMATORS = ["grpo", "rloo", "reinforce_pp", "gae"]
LOSSES = {
    "ppo_clip": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28},
    "dual_clip": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
    "gspo": {"name": "gspo"},
}  # GSPO's own sequence-level bounds


def recipe(algorithm: dict) -> dict:
    """A small task with rewards that differ from the first step: guess a number in [1, 9] in three
    tries (a user's env by import path), one digit per turn."""
    return {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 2,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "log_every_n_steps": 1,
        },
        "model": {
            "model": "earl-tiny",
            "transcripts": {"every_n_steps": 0},
            "algorithm": algorithm,
            "rollout": {
                "max_turns": 3,
                "max_context_tokens": 512,
                "sampling": {"max_new_tokens": 1, "allowed_tokens": list("123456789")},
            },
            "optim": {"lr": 1e-3, "micro_batch_tokens": 2048},
        },
        "data": {
            "env": "tests.plugins.envs.GuessGame",
            "env_kwargs": {"low": 1, "high": 9, "max_guesses": 3},
            "batch_size": 8,
            "group_size": 4,
            "eval_episodes": 0,
        },
    }


def fit(tmp_path: Path, algorithm: dict) -> dict[str, list[float]]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(algorithm)))
    main(["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path / "run")])
    return scalars(tmp_path / "run")


def check(logged: dict[str, list[float]]) -> None:
    assert len(logged["loss/policy"]) == 2, "two RL steps were logged"
    assert all(math.isfinite(v) for v in logged["loss/policy"])
    assert max(logged["grad_norm"]) > 0


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_and_loss_from_yaml_fit_two_steps(tmp_path, estimator, loss):
    logged = fit(tmp_path, {"advantage": {"name": estimator}, "loss": LOSSES[loss]})
    check(logged)
    # the value head comes with the estimator
    assert ("loss/value" in logged) == (estimator == "gae")
    assert ("policy/dual_clip_frac" in logged) and "policy/clip_frac" in logged


def test_gigpo_fits_two_steps_on_turn_rows(tmp_path):
    cfg = recipe(
        {"advantage": {"name": "gigpo", "kwargs": {"step_weight": 0.5}}, "loss": LOSSES["ppo_clip"]}
    )
    # one row per turn: GiGPO compares turns in the same state
    cfg["model"]["rollout"]["history_turns"] = 0
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    main(["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path / "run")])
    check(scalars(tmp_path / "run"))


def test_user_loss_and_estimator_by_import_path_fit_two_steps(tmp_path):
    logged = fit(
        tmp_path,
        {
            "advantage": {"name": "tests.plugins.algorithms.whole_batch_baseline"},
            "loss": {
                "name": "tests.plugins.algorithms.centered_reinforce_loss",
                "kwargs": {"scale": 0.5},
            },
        },
    )
    check(logged)
    # the user loss's own statistics
    assert "policy/ratio_mean" in logged and "policy/clip_frac" not in logged

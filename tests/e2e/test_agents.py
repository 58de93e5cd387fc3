"""A user's agent trained through `earl fit` (issue 53): the calculator task as an OpenAI-SDK agent
from its recipe, exact resume from a checkpoint, two processes under EarlStrategy (each rank's
endpoint serving its own episodes), and the environment libraries' adapters training from their
recipes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from earl_lightning.cli import main
from tests.distributed.launch import subprocess_env
from tests.e2e.test_resume import last_state, recipe_checkpointing_every_step, scalars
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
RECIPES = ROOT / "recipes"
QUIET = ["--trainer.enable_progress_bar", "false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calculator")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_calculator.py"),
            "--out",
            str(out),
            "--train",
            "64",
            "--test",
            "8",
        ],
        check=True,
        capture_output=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
    )
    return out


def agent_args(recipe: Path, data: Path, root: Path, steps: int, *extra: str) -> list[str]:
    files = {"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")}
    return [
        "fit",
        "--config",
        str(recipe),
        "--model.model",
        "earl-tiny-bpe-4l",
        "--data.dataset.data_files",
        json.dumps(files),
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.val_check_interval",
        "100",
        "--trainer.limit_val_batches",
        "0",
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "0",
        "--model.rollout.sampling.max_new_tokens",
        "8",
        *QUIET,
        *extra,
    ]


def test_the_calculator_agent_recipe_trains(data, tmp_path):
    main(agent_args(RECIPES / "calculator_agent_grpo_warm.yaml", data, tmp_path, 2))
    rewards = scalars(tmp_path, "reward/mean")
    assert sorted(rewards) == [0, 1]
    assert scalars(tmp_path, "env/errors") == {0: 0.0, 1: 0.0}, "no agent failed"
    assert max(scalars(tmp_path, "logprob/mismatch").values()) < 1e-4, (
        "the sampled log-probs the endpoint recorded are the trainer's"
    )
    assert (tmp_path / "lightning_logs" / "version_0" / "hf_model").is_dir()


def test_an_agent_run_resumes_bit_identical(data, tmp_path):
    recipe = recipe_checkpointing_every_step(tmp_path, RECIPES / "calculator_agent_grpo_warm.yaml")
    # constant: an interrupted run's cosine schedule spans the same max_steps; these runs do not
    varied = (
        "--data.agent",
        "tests.plugins.agents.varied",
        "--model.optim.lr_schedule",
        "constant",
    )
    full, part = tmp_path / "full", tmp_path / "part"
    main(agent_args(recipe, data, full, 4, *varied))
    main(agent_args(recipe, data, part, 2, *varied))
    main(agent_args(recipe, data, part, 4, "--ckpt_path", "last", *varied))
    a, b = last_state(full), last_state(part)
    assert a["global_step"] == b["global_step"] == 4
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(
            b["state_dict"][k], v, rtol=0, atol=0, msg=f"parameter {k} differs"
        )
    ra, rb = scalars(full, "reward/mean"), scalars(part, "reward/mean")
    assert len(ra) == 4 and ra == rb
    assert len(set(ra.values())) > 1, "the rewards vary: the updates are real"


def test_two_processes_under_earl_strategy_each_serve_their_episodes(data, tmp_path):
    earl = Path(sys.executable).with_name("earl")
    argv = agent_args(
        RECIPES / "calculator_agent_grpo_warm.yaml",
        data,
        tmp_path,
        2,
        "--data.agent",
        "tests.plugins.agents.varied",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "earl",
    )
    proc = run_earl_process(
        [str(earl), *argv],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(scalars(tmp_path, "reward/mean")) == [0, 1]
    assert scalars(tmp_path, "env/errors") == {0: 0.0, 1: 0.0}, (
        "every episode of both ranks ended well"
    )
    assert "tokens/generated" in proc.stderr or scalars(tmp_path, "tokens/generated")


@pytest.mark.parametrize("recipe", ["gymnasium_guess_grpo", "openenv_letter_grpo"])
def test_an_environment_library_env_trains_five_steps_from_its_recipe(recipe, tmp_path):
    main(
        [
            "fit",
            "--config",
            str(RECIPES / f"{recipe}.yaml"),
            "--trainer.max_steps",
            "5",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.limit_val_batches",
            "0",
            "--data.batch_size",
            "16",
            "--data.group_size",
            "4",
            *QUIET,
        ]
    )
    rewards = scalars(tmp_path, "reward/mean")
    assert sorted(rewards) == [0, 1, 2, 3, 4]
    assert (
        scalars(tmp_path, "env/invalid_rate")
        and max(scalars(tmp_path, "env/invalid_rate").values()) == 0.0
    )
    assert max(scalars(tmp_path, "logprob/mismatch").values()) < 1e-4

"""docs/coming_from_trl.md shows one GRPO run as a TRL script, as earl_lightning in Python and as
a YAML recipe: all three run as written (a tiny offline model for the hub id, 2 steps), on the
addition data the project's script writes, with TRL's own accuracy_reward."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import yaml

from earl_lightning.cli import main
from earl_lightning.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "coming_from_trl.md"
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    """A directory holding data/addition/{train,test}.jsonl (small), the page's relative paths."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_addition.py"),
            "--out",
            str(tmp_path / "data" / "addition"),
            "--train",
            "64",
            "--test",
            "8",
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _source(block: str) -> str:
    """The page's program with the tiny model, 2 steps and 2 groups of 8 completions a step (64 on
    the page: the same GRPO code on a quarter of the work)."""
    small = {
        HUB_ID: resolve_model_path("earl-tiny"),
        "max_steps=100": "max_steps=2",
        "batch_size=64": "batch_size=16",  # TRL's per_device_train_batch_size and earl's
    }
    for page, here in small.items():
        assert page in block, page
        block = block.replace(page, here)
    return block


def test_the_trl_script_runs(workdir):
    trl = next(b for b in blocks("python") if "GRPOTrainer(" in b)
    scope: dict = {}
    exec(
        compile(
            _source(trl).replace(
                'output_dir="runs/trl_addition"',
                'output_dir="runs/trl", report_to=[], use_cpu=True, disable_tqdm=True',
            ),
            str(PAGE),
            "exec",
        ),
        scope,
    )
    assert scope["trainer"].state.global_step == 2


def test_the_earl_python_program_runs(workdir, monkeypatch):
    earl = next(b for b in blocks("python") if "EpisodeDataModule(" in b)
    made = []

    class Quiet(lightning.Trainer):
        def __init__(self, **kwargs):
            kwargs.update(
                val_check_interval=2, default_root_dir=str(workdir), enable_progress_bar=False
            )
            super().__init__(**kwargs)
            made.append(self)

    monkeypatch.setattr(lightning, "Trainer", Quiet)
    exec(compile(_source(earl), str(PAGE), "exec"), {})
    metrics = made[0].callback_metrics
    assert made[0].global_step == 2
    saved = workdir / "runs" / "earl_addition" / "model"  # the page's save_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(saved)
    assert AutoTokenizer.from_pretrained(saved).chat_template
    assert {
        "rewards/accuracy_reward/mean",
        "rewards/format_reward/mean",
        "val/rewards/accuracy_reward",
    } <= set(metrics)


def test_the_yaml_recipe_runs(workdir):
    earl = next(b for b in blocks("python") if "EpisodeDataModule(" in b)
    (workdir / "my_rewards.py").write_text(
        re.search(r"def format_reward.*?\n\n\n", earl, flags=re.S).group()
    )
    recipe = yaml.safe_load(blocks("yaml")[0])
    recipe["model"]["model"] = resolve_model_path("earl-tiny")
    (workdir / "my_grpo.yaml").write_text(yaml.safe_dump(recipe))
    sys.path.insert(0, str(workdir))
    try:
        main(
            [
                "fit",
                "--config",
                "my_grpo.yaml",
                "--trainer.max_steps",
                "2",
                "--trainer.val_check_interval",
                "2",
                "--trainer.enable_progress_bar",
                "false",
                "--trainer.default_root_dir",
                str(workdir / "run"),
                "--data.eval_episodes",
                "4",
                "--data.batch_size",  # 64 on the page: 2 groups of 8 run the same code
                "16",
            ]
        )
    finally:
        sys.path.remove(str(workdir))
        sys.modules.pop("my_rewards", None)
    assert list((workdir / "run").rglob("events.out.tfevents.*"))

"""`earl sft`: the warm-start recipe runs through the real command, saves a model directory that
`from_pretrained` loads back and that reproduces its held-out evaluation (also as the RL run's
step-0 evaluation); the loss covers the assistant tokens only; bad input fails in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from earl_lightning.cli import main
from earl_lightning.models.tiny import PRESETS
from earl_lightning.sft import DemonstrationDataModule, WarmStartModule
from tests.earl_process import run_earl_process

RECIPES = Path(__file__).parents[2] / "recipes"
SFT = RECIPES / "connect4_sft.yaml"


def env_recipes(pattern: str) -> list[Path]:
    """The recipes of environment tasks (a dataset task's recipes need its data: tests/e2e/test_dataset_tasks.py)."""
    return sorted(
        p for p in RECIPES.glob(pattern) if "dataset" not in yaml.safe_load(p.read_text())["data"]
    )


SMALL = [
    "--data.num_episodes",
    "24",
    "--data.eval_episodes",
    "8",
    "--data.batch_size",
    "32",
    "--trainer.max_epochs",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    # module-scoped: conftest's per-test argv fixture is not active yet
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["earl"])
        _sft(root)
    return root / "model"


def _sft(root: Path) -> None:
    main(
        [
            "sft",
            "--config",
            str(SFT),
            "--output_dir",
            str(root / "model"),
            "--trainer.default_root_dir",
            str(root),
            *SMALL,
        ]
    )


def _recipe_rollout() -> dict:
    return yaml.safe_load(SFT.read_text())["model"]["rollout"]


def test_the_saved_warm_start_reloads_and_reproduces_its_evaluation(warm_start):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"config.json", "model.safetensors", "tokenizer.json", "warm_start.json"} <= {
        p.name for p in warm_start.iterdir()
    }
    AutoModelForCausalLM.from_pretrained(warm_start), AutoTokenizer.from_pretrained(warm_start)
    record = json.loads((warm_start / "warm_start.json").read_text())
    assert (
        record["demonstrations"]["demo/episodes"] == 24
        and record["demonstrations"]["demo/invalid_rate"] == 0.0
    )
    assert record["data"]["targets"] == "expected" and not any(
        k.startswith("_") for k in record["data"]
    )
    module = WarmStartModule(model=str(warm_start), rollout=_recipe_rollout())
    data = DemonstrationDataModule(
        env="connect_four", env_kwargs={"opponent": "random", "seat": "alternate"}, eval_episodes=8
    )
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (again,) = trainer.validate(module, datamodule=data, verbose=False)
    assert {k: again[k] for k in record["evaluation"]} == record["evaluation"]
    assert {"val/win_rate", "val/invalid_rate", "val_sampled/win_rate"} <= set(record["evaluation"])


def test_rl_starts_from_the_warm_start_and_its_step_0_evaluation_is_the_warm_starts(
    warm_start, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main(
        [
            "fit",
            "--config",
            str(RECIPES / "connect4_grpo_warm.yaml"),
            "--model.model",
            str(warm_start),
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--data.eval_episodes",
            "8",
            "--data.batch_size",
            "8",
            "--data.group_size",
            "4",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    acc = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    acc.Reload()
    record = json.loads((warm_start / "warm_start.json").read_text())["evaluation"]
    for name in ("val/win_rate", "val/invalid_rate", "val/reward"):
        first = [e for e in acc.Scalars(name) if e.step == 0]
        assert first and first[0].value == pytest.approx(record[name], abs=1e-6), name


def test_the_loss_covers_the_assistant_tokens_only(warm_start):
    module = WarmStartModule(model=str(warm_start), rollout=_recipe_rollout())
    module.configure_model()
    data = DemonstrationDataModule(env="connect_four", num_episodes=3, batch_size=4)
    data.trainer = type("T", (), {"lightning_module": module, "world_size": 1})()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        logits = module.policy(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    targets, mask = batch["labels"][:, 1:], batch["labels"][:, 1:] != -100
    logp = (
        torch.log_softmax(logits[:, :-1].float(), -1)
        .gather(-1, targets.clamp(min=0).unsqueeze(-1))
        .squeeze(-1)
    )
    manual = -(logp * mask).sum() / mask.sum()
    out = module.policy(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)
    # the labelled tokens are exactly the rollout's action-mask tokens: one column digit per row here
    assert int(mask.sum()) == batch["input_ids"].shape[0]
    digits = {module.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(7)}
    assert set(targets[mask].tolist()) <= digits
    # random_legal states its distribution: each row's one labelled token is trained on it (expected targets)
    assert sorted(batch["soft_rows"].tolist()) == list(range(batch["input_ids"].shape[0]))
    assert all(batch["labels"][r, p] != -100 for r, p in zip(batch["soft_rows"], batch["soft_pos"]))
    assert set(batch["soft_tokens"].tolist()) <= digits


def test_an_output_dir_that_exists_and_is_not_empty_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main(["sft", "--config", str(SFT), "--output_dir", str(out), *SMALL])
    assert exit_.value.code == 2
    assert (
        f"earl: error: `--output_dir` {str(out)!r} exists and is not empty; pass --overwrite to replace it"
        in capsys.readouterr().err
    )
    assert (out / "notes.txt").read_text() == "mine"
    main(
        [
            "sft",
            "--config",
            str(SFT),
            "--output_dir",
            str(out),
            "--overwrite",
            "--trainer.default_root_dir",
            str(tmp_path),
            *SMALL,
            "--data.num_episodes",
            "4",
            "--data.eval_episodes",
            "2",
        ]
    )
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--data.policy", "random_legl"],
            "earl: error: unknown `--data.policy` 'random_legl'; valid demonstration policies: "
            "['centre_first', 'imperfect_calculator', 'imperfect_inventory', 'random_legal']",
        ),
        (
            ["--data.policy", "tests.unit.test_demonstrations.returns_int"],
            "earl: error: demonstration policy 'tests.unit.test_demonstrations.returns_int' returned 3 (type int) for "
            "the observation",
        ),
        ([], "earl: error: `--output_dir` is required"),
        (
            ["--data.targets", "soft"],
            "earl: error: `--data.targets`: 'soft' is not one of 'expected', 'sampled'\n"
            "earl: `earl sft --help` lists every option",
        ),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, capsys):
    out = [] if not args else ["--output_dir", str(tmp_path / "m")]
    config = SFT.read_text().replace("output_dir: runs/connect4_sft/model\n", "")
    (tmp_path / "sft.yaml").write_text(config)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "sft",
                "--config",
                str(tmp_path / "sft.yaml"),
                *out,
                "--trainer.default_root_dir",
                str(tmp_path),
                *SMALL,
                *args,
            ]
        )
    assert exit_.value.code in (1, 2)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()  # nothing half-saved


def _assert_one_family(recipes: list[Path], task_keys: set[tuple[str, str]]) -> None:
    """Every recipe has the first one's trainer, model and data settings, ``task_keys`` aside."""

    def shared(path: Path) -> dict:
        cfg = yaml.safe_load(path.read_text())
        return {
            (section, k): v
            for section in ("trainer", "model", "data")
            for k, v in cfg[section].items()
            if (section, k) not in task_keys
        }

    first = shared(recipes[0])
    for other in recipes[1:]:
        assert shared(other) == first, f"{other.name} changes more than the task"


def test_the_warm_family_differs_only_in_the_task():
    task_keys = {
        ("model", "model"),
        ("model", "rollout"),
        ("data", "env"),
        ("data", "env_kwargs"),
        ("data", "eval_env_kwargs"),
        ("trainer", "default_root_dir"),
    }
    family = env_recipes("*_warm.yaml")
    assert len(family) >= 2
    for algo in ("grpo", "ppo"):
        _assert_one_family([p for p in family if p.stem.endswith(f"_{algo}_warm")], task_keys)


def test_the_warm_starts_differ_only_in_the_task():
    """Every `*_sft.yaml` trains the same model with the same optimizer, clipping, batch and epochs;
    a task sets its env, its demonstration policy and how many demonstrations it plays."""
    task_keys = {
        ("model", "rollout"),
        ("data", "env"),
        ("data", "env_kwargs"),
        ("data", "eval_env_kwargs"),
        ("data", "policy"),
        ("data", "policy_kwargs"),
        ("data", "num_episodes"),
        ("trainer", "default_root_dir"),
    }
    recipes = env_recipes("*_sft.yaml")
    assert len(recipes) >= 4
    _assert_one_family(recipes, task_keys | {("model", "model")})
    # one model size; a tool task may take the same model with a BPE tokenizer (its JSON is short),
    # or another recipe's warm start of it (a model that already calls tools)
    assert {base_model(p) for p in recipes} <= {"earl-tiny-4l", "earl-tiny-bpe-4l"}
    assert PRESETS["earl-tiny-bpe-4l"] == {**PRESETS["earl-tiny-4l"], "tokenizer": "bpe"}


def base_model(recipe: Path) -> str:
    """The preset a warm-start recipe starts from: its model, or the model of the recipe whose
    warm start (``output_dir``) it continues."""
    model = yaml.safe_load(recipe.read_text())["model"]["model"]
    outputs = {yaml.safe_load(p.read_text())["output_dir"]: p for p in env_recipes("*_sft.yaml")}
    return base_model(outputs[model]) if model in outputs else model


def test_seeds_script_runs_warm_start_then_rl_per_seed_and_reports_curves(tmp_path):
    import csv
    import subprocess

    script = Path(__file__).parents[2] / "scripts" / "seeds.py"
    small_sft = tmp_path / "sft.yaml"
    cfg = yaml.safe_load(SFT.read_text())
    cfg["data"].update(eval_episodes=4, batch_size=16)
    small_sft.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(  # the demonstrations' count reaches earl sft through --sft-arg
        [
            sys.executable,
            str(script),
            "--sft",
            str(small_sft),
            "--config",
            str(RECIPES / "connect4_grpo_warm.yaml"),
            "--sft-arg=--data.num_episodes=8",
            "--sft-arg=--trainer.max_epochs=1",
            "--seeds",  # two: the summary and the plot's mean are per seed
            "0",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--",
            "--trainer.max_steps=1",  # a curve's start (step 0) and its end after an update
            "--trainer.val_check_interval=1",
            "--data.eval_episodes=4",
            "--data.batch_size=8",
            "--data.group_size=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "out" / "curves.csv").open()))
    for seed in ("0", "1"):
        steps = sorted(
            {int(r["step"]) for r in rows if r["seed"] == seed and r["metric"] == "val/win_rate"}
        )
        assert steps == [0, 1]
    summary = list(csv.DictReader((tmp_path / "out" / "summary.csv").open()))
    assert [r["seed"] for r in summary] == ["0", "1"]
    assert {
        "start_win_rate",
        "final_win_rate",
        "warm_sampled/win_rate",
        "sft_wall_s",
        "rl_wall_s",
    } <= set(summary[0])
    for r in summary:  # step 0 of the RL curve is the warm start's own greedy evaluation
        warm = json.loads(
            (tmp_path / "out" / f"seed{r['seed']}" / "warm_start" / "warm_start.json").read_text()
        )
        assert float(r["start_win_rate"]) == pytest.approx(
            warm["evaluation"]["val/win_rate"], abs=1e-4
        )
        assert warm["demonstrations"]["demo/episodes"] == 8
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000


def test_seeds_script_refuses_sft_args_without_a_warm_start(tmp_path):
    import subprocess

    script = Path(__file__).parents[2] / "scripts" / "seeds.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--config",
            str(RECIPES / "connect4_grpo_warm.yaml"),
            "--sft-arg=--data.num_episodes=8",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "`--sft-arg` '--data.num_episodes=8' needs `--sft`" in proc.stderr


@pytest.mark.parametrize("recipe", env_recipes("*_sft.yaml"), ids=lambda p: p.stem)
def test_every_warm_start_recipe_smoke_runs(recipe, tmp_path):
    # a recipe that continues another's warm start runs here from that one's preset
    main(
        [
            "sft",
            "--config",
            str(recipe),
            "--model.model",
            base_model(recipe),
            "--output_dir",
            str(tmp_path / "model"),
            "--trainer.default_root_dir",
            str(tmp_path),
            *SMALL,
            "--data.num_episodes",
            "4",
            "--data.eval_episodes",
            "2",
            "--data.batch_size",
            "16",
        ]
    )
    record = json.loads((tmp_path / "model" / "warm_start.json").read_text())
    assert (
        record["demonstrations"]["demo/errors"] == 0
        and record["demonstrations"]["demo/invalid_rate"] == 0
    )
    assert "val/reward" in record["evaluation"]


@pytest.mark.parametrize("recipe", env_recipes("*_warm.yaml"), ids=lambda p: p.stem)
def test_every_warm_rl_recipe_builds_from_a_warm_start(recipe, warm_start, tmp_path):
    """Every warm recipe's module and data module are built from its YAML (settings checked, the
    warm start loaded); one GRPO and one PPO recipe of another task also run a step."""
    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule

    cfg = yaml.safe_load(recipe.read_text())
    module = AgenticRLModule(**{**cfg["model"], "model": str(warm_start)})
    EpisodeDataModule(**cfg["data"])
    assert module.tokenizer is not None
    if recipe.stem in ("calculator_grpo_warm", "tictactoe_ppo_warm"):
        main(
            [
                "fit",
                "--config",
                str(recipe),
                "--model.model",
                str(warm_start),
                "--trainer.max_steps",
                "1",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--data.eval_episodes",
                "2",
                "--data.batch_size",
                "4",
                "--data.group_size",
                "2",
                "--trainer.enable_progress_bar",
                "false",
            ]
        )
        assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_warm_start_on_two_processes_saves_once_and_its_evaluation_covers_every_seed(tmp_path):
    """`earl sft --trainer.devices 2` (DDP on gloo): each rank trains on half of every batch and
    plays half of the held-out seeds; rank 0 saves once, and the saved model, evaluated again in one
    process over all the seeds, reproduces the evaluation the two ranks recorded together."""

    from tests.distributed.launch import subprocess_env

    earl = Path(sys.executable).with_name("earl")
    out = tmp_path / "model"
    cmd = [
        str(earl),
        "sft",
        "--config",
        str(SFT),
        "--output_dir",
        str(out),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        *SMALL,
    ]
    proc = run_earl_process(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("earl: warm start saved to") == 1 and not list(
        tmp_path.glob(".model.tmp*")
    )
    record = json.loads((out / "warm_start.json").read_text())
    assert record["demonstrations"]["demo/episodes"] == 24
    module = WarmStartModule(model=str(out), rollout=_recipe_rollout())
    data = DemonstrationDataModule(
        env="connect_four", env_kwargs={"opponent": "random", "seat": "alternate"}, eval_episodes=8
    )
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (again,) = trainer.validate(module, datamodule=data, verbose=False)
    for name in ("val/win_rate", "val/invalid_rate", "val/reward", "val/turns"):
        assert again[name] == pytest.approx(record["evaluation"][name], abs=1e-6), name

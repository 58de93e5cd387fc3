"""A prompt dataset scored by reward functions through the `earl` command: the warm start from the
dataset, RL from it, exact resume, and one clear line for each kind of bad input; the same in
Python with a `datasets.Dataset` and callables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import lightning as L
import pytest
import torch

from earl_lightning.cli import main
from tests.e2e.test_resume import last_state, scalars
from tests.earl_process import run_earl_process
from tests.load import load_repo_file

ROOT = Path(__file__).parents[2]
QUIET = ["--trainer.enable_progress_bar", "false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A small addition dataset written by the project's own script (its ``main``, in this
    process: no interpreter to start for it)."""
    out = tmp_path_factory.mktemp("addition")
    script = load_repo_file("scripts/make_addition.py", "make_addition")
    argv = ["make_addition.py", "--out", str(out), "--train", "96", "--test", "16"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", argv)
        script.main()
    return out


def _files(data: Path) -> list[str]:
    return [
        "--data.dataset.data_files",
        json.dumps({"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")}),
    ]


def _fit_args(data: Path, root: Path, model: str, steps: int, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "recipes" / "addition_grpo_warm.yaml"),
        "--model.model",
        model,
        *_files(data),
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.val_check_interval",
        "2",
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "4",
        *QUIET,
        *extra,
    ]


@pytest.fixture(scope="module")
def warm_start(data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["earl"])
        main(
            [
                "sft",
                "--config",
                str(ROOT / "recipes" / "addition_sft.yaml"),
                "--output_dir",
                str(root / "model"),
                "--trainer.default_root_dir",
                str(root),
                *_files(data),
                "--trainer.max_steps",
                "3",
                "--trainer.val_check_interval",
                "3",
                "--data.batch_size",
                "16",
                "--data.eval_episodes",
                "8",
                *QUIET,
            ]
        )
    return root / "model"


def test_the_dataset_warm_start_then_rl_logs_each_reward_function(warm_start, data, tmp_path):
    record = json.loads((warm_start / "warm_start.json").read_text())
    assert record["demonstrations"]["demo/rows"] == 96
    assert "val/rewards/accuracy_reward" in record["evaluation"]
    main(
        _fit_args(
            data,
            tmp_path,
            str(warm_start),
            2,
            "--data.reward_funcs",
            "[trl.rewards.accuracy_reward, tests.plugins.rewards.brevity]",
            "--data.reward_weights",
            "[1.0, 0.5]",
        )
    )
    for tag in (
        "rewards/accuracy_reward/mean",
        "rewards/accuracy_reward/std",
        "rewards/brevity/mean",
        "rewards/errors",
        "val/rewards/accuracy_reward",
        "reward/mean",
        "loss/policy",
    ):
        assert scalars(tmp_path, tag), f"{tag} not logged"
    first = scalars(tmp_path, "val/rewards/accuracy_reward")[0]
    assert first == pytest.approx(record["evaluation"]["val/rewards/accuracy_reward"], abs=1e-6), (
        "step 0 of RL is the warm start's own held-out evaluation"
    )
    step = scalars(tmp_path, "reward/mean")
    acc, brief = (
        scalars(tmp_path, "rewards/accuracy_reward/mean"),
        scalars(tmp_path, "rewards/brevity/mean"),
    )
    for k in step:
        assert step[k] == pytest.approx(acc[k] + 0.5 * brief[k], abs=1e-5), (
            "the reward is the weighted sum"
        )


def test_the_lora_recipe_is_the_full_recipe_with_adapters_and_runs_from_the_warm_start(
    warm_start, data, tmp_path
):
    """recipes/addition_grpo_lora.yaml (docs/experiments/lora.md) differs from the full fine-tuning recipe only
    in `model.peft`, the learning rate and its run directory, and runs (what LoRA trains: tests/e2e/test_lora.py)."""
    import yaml

    full, lora = (
        yaml.safe_load((ROOT / "recipes" / f"addition_grpo_{name}.yaml").read_text())
        for name in ("warm", "lora")
    )
    assert lora["model"].pop("peft") == {
        "r": 16,
        "alpha": 32,
        "dropout": 0.0,
        "target_modules": "all-linear",
    }
    assert (full["model"]["optim"].pop("lr"), lora["model"]["optim"].pop("lr")) == (3.0e-5, 3.0e-4)
    full["trainer"].pop("default_root_dir"), lora["trainer"].pop("default_root_dir")
    assert lora == full
    args = _fit_args(data, tmp_path, str(warm_start), 2)
    args[2] = str(ROOT / "recipes" / "addition_grpo_lora.yaml")
    main(args)
    assert len(scalars(tmp_path, "loss/policy")) == 2 and scalars(
        tmp_path, "val/rewards/accuracy_reward"
    )


def test_resume_over_a_dataset_matches_the_uninterrupted_run(warm_start, data, tmp_path):
    every_step = [
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.limit_val_batches",
        "0",
        # answers cut at 8 characters, not 24: the resume's bit-identity does not need them whole,
        # and the 8 steps' generation is a third of the work
        "--model.rollout.sampling.max_new_tokens",
        "8",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    main(_fit_args(data, full, str(warm_start), 4, *every_step))
    main(_fit_args(data, part, str(warm_start), 2, *every_step))
    main(_fit_args(data, part, str(warm_start), 4, *every_step, "--ckpt_path", "last"))
    a, b = last_state(full), last_state(part)
    assert a["global_step"] == b["global_step"] == 4
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(
            b["state_dict"][k], v, rtol=0, atol=0, msg=f"parameter {k} differs"
        )
    assert scalars(full, "reward/mean") == scalars(part, "reward/mean")


def test_a_broken_reward_function_ends_the_run_in_one_line_naming_it(
    warm_start, data, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_:
        main(
            _fit_args(
                data,
                tmp_path,
                str(warm_start),
                2,
                "--data.reward_funcs",
                "[tests.plugins.rewards.broken]",
                "--data.reward_weights",
                "null",
            )
        )
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("earl: error:")]
    assert line == [
        "earl: error: reward function 'broken' raised ValueError: this reward function is broken (8 of 8 "
        "episodes of RL step 0 could not be scored (`--model.rollout.max_failed_share` 1)). Fix the reward "
        "function, or raise max_failed_share to train on the rows it scores"
    ]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--data.dataset.path", "no/such/dataset_here"],
            "earl: error: `--data.dataset.path` 'no/such/dataset_here': cannot load the dataset",
        ),
        (
            [
                "--data.reward_funcs",
                "[tests.plugins.rewards.no_completions]",
                "--data.reward_weights",
                "null",
            ],
            "takes no `completions`",
        ),
        (
            [
                "--data.reward_funcs",
                "[tests.plugins.rewards.exact_sum]",
                "--data.reward_weights",
                "null",
            ],
            "'exact_sum' needs ['answer'], which the rows do not have; their columns: ['solution']",
        ),
        (
            ["--data.reward_funcs", "[tests.plugins.rewards.exact_sum]"],
            "earl: error: `--data.reward_weights` has 2 weights for 1 reward functions",
        ),
        (
            ["--data.dataset.eval_split", "validation"],
            "earl: error: `--data.dataset.eval_split` 'validation' is not a split",
        ),
        (
            ["--data.reward_funcs", "[]", "--data.reward_weights", "null"],
            "earl: error: `--data.reward_funcs` is empty, and `--data.env` is null",
        ),
    ],
)
def test_bad_input_is_one_line(args, message, warm_start, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(_fit_args(data, tmp_path, str(warm_start), 1, *args))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_python_api_with_a_dataset_and_callables(tmp_path):
    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule

    def rows(lo, hi):
        return datasets.Dataset.from_list(
            [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(lo, hi)]
        )

    async def says_a_number(completions, **kwargs):
        return [1.0 if c.strip()[:1].isdigit() else 0.0 for c in completions]

    dm = EpisodeDataModule(
        dataset=rows(0, 20),
        eval_dataset=rows(50, 54),
        batch_size=8,
        group_size=4,
        reward_funcs=["tests.plugins.rewards.exact_sum", says_a_number],
        eval_episodes=4,
    )
    module = AgenticRLModule(rollout={"max_turns": 1, "sampling": {"max_new_tokens": 4}})
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, dm)
    metrics = trainer.callback_metrics
    assert {
        "rewards/exact_sum/mean",
        "rewards/says_a_number/mean",
        "val/rewards/says_a_number",
    } <= set(metrics)


@pytest.mark.parametrize(
    "layouts",
    [None, "{rollout: {dp: 1, tp: 2}, experience: {dp: 2, tp: 1}, train: {dp: 2, tp: 1}}"],
)
def test_a_dataset_task_on_two_processes(data, tmp_path, layouts):
    """2 gloo processes under EarlStrategy (data parallel; or the rollout at tp 2): each rank scores
    its own rows, the per-function figures are the global ones (one function at weight 1: its mean
    is the step's reward), and the evaluation covers every evaluation row once."""
    from tests.distributed.launch import subprocess_env
    from tests.e2e.test_multiprocess import scalars as all_scalars

    earl = Path(sys.executable).with_name("earl")
    cmd = [
        str(earl),
        "fit",
        "--config",
        str(ROOT / "recipes" / "addition_grpo_warm.yaml"),
        "--model.model",
        "earl-tiny",
        *_files(data),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "{class_path: earl_lightning.strategies.EarlStrategy, init_args: {layouts: %s}}"
        % (layouts or "null"),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--data.batch_size",
        "16",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "8",
        "--data.reward_funcs",
        "[trl.rewards.accuracy_reward, tests.plugins.rewards.brevity]",
        "--data.reward_weights",
        "[1.0, 0.0]",
        # 8 characters an answer, not the recipe's 24: every rank's answers are still scored and
        # long enough for brevity to be negative, and generation is a third of the work (at tp 2
        # each token is a collective over both ranks)
        "--model.rollout.sampling.max_new_tokens",
        "8",
        *QUIET,
    ]
    proc = run_earl_process(
        cmd, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = all_scalars(tmp_path)
    assert s["rewards/accuracy_reward/mean"] == pytest.approx(s["reward/mean"], abs=1e-6)
    assert all(v < 0 for v in s["rewards/brevity/mean"]), "every rank's rows are scored"
    assert s["val/rewards/accuracy_reward"] == pytest.approx(s["val/reward"], abs=1e-6)
    assert max(s["logprob/mismatch"]) < 1e-4
    assert "sync_dist" not in proc.stderr, proc.stderr[-4000:]


def test_a_dataset_task_with_tools_from_the_command_line(data, tmp_path):
    """Rows, a tool named by import path and the model's parser: every prompt carries the tool, the
    tools' counts are logged (a random model seldom calls one: the counts may be 0)."""
    main(
        _fit_args(
            data,
            tmp_path,
            "earl-tiny",
            2,
            "--data.tools",
            "[tests.plugins.tools.add]",
            "--model.rollout.tool_parser",
            "hermes",
            "--model.rollout.max_context_tokens",
            "1024",
        )
    )
    for tag in (
        "tools/calls",
        "tools/errors",
        "tools/seconds",
        "tools/truncated",
        "rewards/accuracy_reward/mean",
    ):
        assert scalars(tmp_path, tag), f"{tag} not logged"


def test_tools_without_a_parser_are_one_line(data, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(
            _fit_args(
                data,
                tmp_path,
                "earl-tiny",
                1,
                "--data.tools",
                "[tests.plugins.tools.add]",
                "--model.rollout.tool_parser",
                "null",
            )
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        "earl: error: `--data.tools` names tools ['add'], and `--model.rollout.tool_parser` is null: set the "
        "parser of the model's tool-call format"
    ) in err and "Traceback" not in err


def test_a_hung_reward_function_ends_the_run_in_one_line(data, tmp_path):
    """A reward function that sleeps 60 s under a 1 s limit: it is interrupted where it sleeps, in
    the evaluation before the first update and again at step 0, whose rows it then has not scored,
    and the run ends as a raising function ends it (every row unscored: ``max_failed_share`` 1),
    not hung."""
    from tests.distributed.launch import subprocess_env

    earl = Path(sys.executable).with_name("earl")
    args = _fit_args(data, tmp_path, "earl-tiny", 2, "--data.reward_funcs")
    args += ["[tests.plugins.rewards.sleepy]", "--data.reward_weights", "null"]
    args += ["--model.rollout.reward_timeout_s", "1"]
    proc = run_earl_process(
        [str(earl), *args],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Not timed here (a loaded machine makes start-up alone take a minute): a function left to
    # sleep would return its scores after 60 s and the run would end well, not with this line.
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "earl: error: reward function 'sleepy' did not return within 1 s "
        "(`--model.rollout.reward_timeout_s`) (8 of 8 episodes of RL step 0 could not be scored "
        "(`--model.rollout.max_failed_share` 1)). Fix the reward function, or raise "
        "max_failed_share to train on the rows it scores"
    )
    assert "Traceback" not in proc.stderr
    assert "where it was:" in proc.stderr and "in sleepy" in proc.stderr, "the hang is logged"

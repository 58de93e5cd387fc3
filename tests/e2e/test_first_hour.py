"""A new user's first hour with `earl`, through the real command (issue 57): a run that learns
nothing says so once (stderr, the progress bar, TensorBoard); transcripts show the episodes asked
for, the first prompt, and every episode goes to a JSON-lines file; the old transcript flag still
works with a deprecation warning; evaluations are drawn at the step the bar shows; the frozen KL
reference raises no eval-mode warning; `earl --help` lists every subcommand and `earl presets`
the offline models; a reward function in the working directory is found without PYTHONPATH."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import subprocess_env
from tests.e2e.test_file_errors import error_line
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
EARL = Path(sys.executable).with_name("earl")
STEPS = 4


def earl(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(EARL), *argv],
        env=subprocess_env(**({"PYTHONPATH": str(ROOT)} | env)),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def rows(path: Path, n: int) -> str:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(n)
        )
    )
    return str(path)


def fit_args(tmp: Path, reward: str, *extra: str) -> list[str]:
    return [
        "fit",
        "--model.model",
        "earl-tiny",
        "--data.dataset",
        json.dumps({"path": rows(tmp / "rows.jsonl", 24), "eval_size": 4}),
        "--data.reward_funcs",
        f"[{reward}]",
        "--data.batch_size",
        "4",
        "--data.group_size",
        "2",
        "--data.eval_episodes",
        "4",
        "--model.rollout.max_turns",
        "1",
        "--model.rollout.sampling.max_new_tokens",
        "4",
        "--trainer.max_steps",
        str(STEPS),
        "--trainer.val_check_interval",
        "2",
        "--trainer.check_val_every_n_epoch",
        "null",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.default_root_dir",
        str(tmp / "run"),
        "--export.enabled",
        "false",
        *extra,
    ]


def events(root: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(next(root.rglob("events.out.tfevents.*"))), size_guidance={"tensors": 0, "scalars": 0}
    )
    acc.Reload()
    return acc


def texts(acc) -> dict[str, list[tuple[int, str]]]:
    return {
        tag.removesuffix("/text_summary"): [
            (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)
        ]
        for tag in acc.Tags()["tensors"]
    }


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run whose reward is the same for every completion, with a KL reference, the old
    transcript flag, the worst episode shown every 2 steps, and every episode dumped."""
    tmp = tmp_path_factory.mktemp("flat")
    proc = earl(
        fit_args(
            tmp,
            "tests.plugins.rewards.same_for_all",
            "--model.algorithm.kl.coef",
            "0.1",
            "--model.no_signal_steps",
            "3",
            "--model.transcript_every_n_steps",
            "2",
            "--model.transcripts.episodes",
            "worst",
            "--model.transcripts.n",
            "1",
            "--dump_episodes",
            str(tmp / "episodes.jsonl"),
        ),
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, proc


def test_a_run_without_learning_signal_says_so_once(flat_run):
    tmp, proc = flat_run
    said = [line for line in proc.stderr.splitlines() if "no learning signal" in line]
    assert len(said) == 1, proc.stderr[-3000:]
    assert (
        "no learning signal for 3 steps in a row: every group's episodes got the same reward "
        "(reward/zero_std_groups 1.0)"
    ) in said[0]
    assert "a warm start (`earl sft`, or more demonstrations in it)" in said[0]
    assert "a larger `--data.group_size`" in said[0]
    assert "no_signal_steps=3" in proc.stdout + proc.stderr, "the bar shows it"
    acc = events(tmp / "run")
    assert [e.value for e in acc.Scalars("train/steps_without_signal")] == [1, 2, 3, 4]


def test_evaluations_are_drawn_at_the_step_the_bar_shows(flat_run):
    tmp, _ = flat_run
    acc = events(tmp / "run")
    assert [e.step for e in acc.Scalars("val/reward")] == [0, 2, 4]


def test_the_frozen_reference_raises_no_eval_mode_warning(flat_run):
    _, proc = flat_run
    assert "module(s) in eval mode" not in proc.stderr


def test_transcripts_show_the_episodes_asked_for_the_prompt_once_and_the_row(flat_run):
    tmp, proc = flat_run
    assert (
        "`--model.transcript_every_n_steps` is deprecated: use `--model.transcripts.every_n_steps`"
        in proc.stderr
    )
    shown = texts(events(tmp / "run"))
    assert set(shown) == {"transcripts/prompt", "transcripts/worst_0"}
    assert [step for step, _ in shown["transcripts/prompt"]] == [0], "the prompt once per run"
    assert shown["transcripts/prompt"][0][1].startswith("The first prompt, as the model reads it: ")
    assert [step for step, _ in shown["transcripts/worst_0"]] == [0, 2]
    head = shown["transcripts/worst_0"][0][1].splitlines()[0]
    assert head.startswith("**row** ") and "answer=`" in head and "env" not in head, head
    assert "(same_for_all +0.50)" in head


def test_every_episode_is_dumped_as_a_json_line(flat_run):
    tmp, _ = flat_run
    lines = [json.loads(line) for line in (tmp / "episodes.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["phase"] == "train"]
    val = [r for r in lines if r["phase"] == "val"]
    assert {r["phase"] for r in lines} == {"train", "val", "sanity"}
    assert [r["step"] for r in train] == [s for s in range(STEPS) for _ in range(4)]
    assert sorted({r["step"] for r in val}) == [0, 2, 4] and len(val) == 12
    first = train[0]
    assert first["row"]["answer"] and first["rewards"] == {"same_for_all": 0.5}
    assert first["completion"] and first["prompt"].startswith("What is ")


def test_help_lists_every_subcommand(tmp_path):
    proc = earl(["--help"], tmp_path)
    assert proc.returncode == 0
    for command in ("fit", "validate", "sft", "export", "profile", "presets"):
        assert f"  earl {command} " in proc.stdout, command


def test_presets_lists_the_offline_models_and_gives_their_directories(tmp_path, capsys):
    """The listing and a preset's directory in-process (`main`, what the `earl` script calls); the
    unknown preset's line through the real command."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from earl_lightning.cli import main
    from earl_lightning.models.tiny import PRESETS

    capsys.readouterr()
    main(["presets"])
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines()[1:] if line.startswith("earl-")}
    assert listed == set(PRESETS)
    assert "byte-level BPE, 2056 ids" in out and "1,051,776" in out
    main(["presets", "earl-tiny-bpe"])
    directory = capsys.readouterr().out.strip()
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert sum(p.numel() for p in model.parameters()) == 657_536
    assert AutoTokenizer.from_pretrained(directory).chat_template
    proc = earl(["presets", "earl-tiny-2"], tmp_path)
    assert proc.returncode == 2
    assert error_line(proc.stderr).startswith("earl: error: unknown preset 'earl-tiny-2'; valid: [")


def test_a_reward_function_in_the_working_directory_is_found(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def says_a_digit(completions, **kwargs):\n"
        "    return [float(any(ch.isdigit() for ch in c)) for c in completions]\n"
    )
    args = fit_args(tmp_path, "my_rewards.says_a_digit", "--trainer.max_steps", "1")
    proc = earl(args, tmp_path)  # PYTHONPATH holds the project only, not the working directory
    assert proc.returncode == 0, proc.stderr[-3000:]

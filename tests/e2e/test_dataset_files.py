"""A dataset file is a dataset, never a settings file, and every row is checked once, when first
read (issue 52, items 9 and 10): an empty file is one line naming it (exit 2); a bad row past the
rows checked at start ends the run when it is reached, in one line naming the row (exit 1), and the
last checkpoint stays. The RL run and the warm start alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from earl_lightning.tasks.datasets import RowOrder
from tests.distributed.launch import subprocess_env
from tests.e2e.test_file_errors import error_line, run_earl
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
EARL = Path(sys.executable).with_name("earl")
GROUPS = 2  # groups per RL step: --data.batch_size 4, --data.group_size 2


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sums(n: int, conversational: bool = False) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"{i}+1="}] if conversational else f"{i}+1=",
            "answer": str(i + 1),
        }
        for i in range(n)
    ]


def _fit(dataset: str, root: Path, steps: int, *extra: str) -> list[str]:
    return [
        "fit",
        "--model.model",
        "earl-tiny",
        "--data.dataset",
        dataset,
        "--data.reward_funcs",
        "[tests.plugins.rewards.exact_sum]",
        "--data.batch_size",
        "4",
        "--data.group_size",
        "2",
        "--data.eval_episodes",
        "0",
        "--model.rollout.max_turns",
        "1",
        "--model.rollout.sampling.max_new_tokens",
        "4",
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--export.enabled",
        "false",
        *extra,
    ]


def _earl(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(EARL), *argv],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_an_empty_jsonl_given_as_the_dataset_is_one_line_not_a_connect_four_run(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = _earl(_fit(str(empty), tmp_path / "run", 1), tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"earl: error: `--data.dataset` {str(empty)!r} is an empty file: the dataset needs at least "
        "one row, with `prompt`; write rows into it or name another file"
    )
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.ckpt"))


def test_data_files_are_read_as_rows_whatever_their_text(tmp_path, capsys):
    """A file's text is never read as settings: a .csv stays a path (it became its own text), a
    row with a `path` column is a row (it named another dataset), an empty file in settings is
    named under `.path`."""
    csv = tmp_path / "sums.csv"
    csv.write_text("prompt,solution\n1+1=,2\n")
    settings_like = _jsonl(tmp_path / "one.jsonl", [{"path": str(tmp_path / "other.jsonl")}])
    _jsonl(tmp_path / "other.jsonl", _sums(4))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases = [
        (
            str(csv),
            "earl: error: `--data.reward_funcs[0]` 'exact_sum' needs ['answer'], which the rows do "
            "not have; their columns: ['solution']",
        ),
        (
            str(settings_like),
            f"earl: error: `--data.dataset` {str(settings_like)!r} has no `prompt` column; its "
            "columns: ['path']. Rename a column with Dataset.rename_column, or map the rows into "
            "that form",
        ),
        (
            f"{{path: {empty}}}",
            f"earl: error: `--data.dataset.path` {str(empty)!r} is an empty file: the dataset needs "
            "at least one row, with `prompt`; write rows into it or name another file",
        ),
    ]
    for dataset, line in cases:
        code, err = run_earl(capsys, _fit(dataset, tmp_path / "run", 1))
        assert (code, error_line(err)) == (2, line)


def _visited_at(step: int, n: int) -> tuple[int, int]:
    """(seed, row) where ``row``, past the rows checked at start (64), is first played at RL step
    ``step`` under that seed."""
    for seed in range(1000):
        order = RowOrder(n, seed)
        row = order[step * GROUPS]
        if row >= 64 and row not in {order[k] for k in range(step * GROUPS)}:
            return seed, row
    raise AssertionError("no seed plays a late row at that step")


def _saving_every_step(tmp_path: Path) -> Path:
    config = tmp_path / "checkpoints.yaml"
    callback = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "save_last": True,
            "save_top_k": 0,
            "every_n_train_steps": 1,
            "dirpath": str(tmp_path / "run" / "checkpoints"),
        },
    }
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    return config


def test_a_null_prompt_past_the_first_rows_ends_the_run_in_one_line_keeping_the_checkpoint(
    tmp_path,
):
    seed, bad = _visited_at(3, 80)
    rows = _sums(80)
    rows[bad]["prompt"] = None
    data = _jsonl(tmp_path / "sums.jsonl", rows)
    argv = _fit(str(data), tmp_path / "run", 5, "--seed_everything", str(seed))
    proc = _earl([*argv, "--config", str(_saving_every_step(tmp_path))], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"earl: error: `--data.dataset` {str(data)!r}, row {bad}: `prompt` must be a string "
        "(standard form) or a list of messages (conversational form), got NoneType None; fix or "
        "remove that row"
    )
    last = torch.load(
        tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    assert last["global_step"] >= 2, "the steps before the bad row are kept"


def test_an_unknown_role_past_the_first_rows_is_one_line_naming_the_roles(tmp_path, capsys):
    seed, bad = _visited_at(1, 70)
    rows = _sums(70, conversational=True)
    rows[bad]["prompt"] = [{"role": "robot", "content": "1+1="}]
    data = _jsonl(tmp_path / "sums.jsonl", rows)
    code, err = run_earl(
        capsys, _fit(str(data), tmp_path / "run", 3, "--seed_everything", str(seed))
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: `--data.dataset` {str(data)!r}, row {bad}: `prompt`, message 0: role "
        "'robot' is not one of ['system', 'user', 'assistant', 'tool']; fix or remove that row"
    )


def _sft(dataset: str, tmp_path: Path) -> list[str]:
    return [
        "sft",
        "--model.model",
        "earl-tiny",
        "--data.dataset",
        dataset,
        "--output_dir",
        str(tmp_path / "model"),
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--trainer.max_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--data.batch_size",
        "4",
        "--data.eval_episodes",
        "0",
    ]


def _chat(i: int, user: str = "user") -> dict:
    return {
        "messages": [
            {"role": user, "content": f"{i}+1="},
            {"role": "assistant", "content": str(i + 1)},
        ]
    }


@pytest.mark.parametrize(
    "rows, line",
    [
        (
            [
                {"prompt": f"{i}+1=", "completion": str(i + 1) if i != 70 else None}
                for i in range(80)
            ],
            "`prompt` and `completion` must both be strings (standard form) or both lists of "
            "messages (conversational form), got str and NoneType",
        ),
        (
            [_chat(i, "robot" if i == 70 else "user") for i in range(80)],
            "`messages`, message 0: role 'robot' is not one of ['system', 'user', 'assistant', "
            "'tool']",
        ),
    ],
    ids=["prompt-completion", "messages"],
)
def test_a_bad_warm_start_row_is_one_line_naming_it(tmp_path, capsys, monkeypatch, rows, line):
    data = _jsonl(tmp_path / "sums.jsonl", rows)
    monkeypatch.setattr(sys, "argv", ["earl"])
    code, err = run_earl(capsys, _sft(str(data), tmp_path))
    assert code == 1
    assert error_line(err) == (
        f"earl: error: `--data.dataset` {str(data)!r}, row 70: {line}; fix or remove that row"
    )
    assert not (tmp_path / "model").exists()


def test_an_empty_warm_start_file_is_one_line(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    monkeypatch.setattr(sys, "argv", ["earl"])
    code, err = run_earl(capsys, _sft(str(empty), tmp_path))
    assert (code, error_line(err)) == (
        2,
        f"earl: error: `--data.dataset` {str(empty)!r} is an empty file: the dataset needs at "
        "least one row, with `prompt` + `completion` or `messages`; write rows into it or name "
        "another file",
    )

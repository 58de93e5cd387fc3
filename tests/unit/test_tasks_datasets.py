"""Prompt datasets: every form `datasets` opens, train and evaluation rows that never meet, the
epoch order of the rows, and one clear line for each kind of bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import numpy as np
import pytest

from earl_lightning.core.errors import EarlError
from earl_lightning.tasks.datasets import DatasetConfig, RowOrder, open_splits, prompt_key
from earl_lightning.tasks.rows import BadRowError, check_rl_row, check_sft_row


def _rows(n: int, start: int = 0, conversational: bool = False) -> list[dict]:
    out = []
    for i in range(start, start + n):
        prompt = f"{i}+1=" if not conversational else [{"role": "user", "content": f"{i}+1="}]
        out.append({"prompt": prompt, "answer": str(i + 1), "level": i % 3})
    return out


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("form", ["jsonl", "parquet", "csv", "arrow", "saved", "builder"])
def test_every_local_form_opens_with_its_columns(tmp_path, form):
    rows = _rows(10)
    ds = datasets.Dataset.from_list(rows)
    if form == "jsonl":
        config = DatasetConfig(path=str(_write_jsonl(tmp_path / "d.jsonl", rows)))
    elif form == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        config = DatasetConfig(path=str(tmp_path / "d.parquet"))
    elif form == "csv":
        ds.to_csv(str(tmp_path / "d.csv"))
        config = DatasetConfig(path=str(tmp_path / "d.csv"))
    elif form == "arrow":
        ds.save_to_disk(str(tmp_path / "saved"))
        (arrow,) = (tmp_path / "saved").glob("*.arrow")
        config = DatasetConfig(path=str(arrow))
    elif form == "saved":
        datasets.DatasetDict(
            {"train": ds, "test": datasets.Dataset.from_list(_rows(3, 100))}
        ).save_to_disk(str(tmp_path / "saved"))
        config = DatasetConfig(path=str(tmp_path / "saved"), eval_split="test")
    else:
        _write_jsonl(tmp_path / "a.jsonl", rows)
        _write_jsonl(tmp_path / "b.jsonl", _rows(3, 100))
        config = DatasetConfig(
            path="json",
            data_files={"train": str(tmp_path / "a.jsonl"), "test": str(tmp_path / "b.jsonl")},
            eval_split="test",
        )
    splits = open_splits(config)
    assert len(splits.train) == 10 and set(splits.columns()) == {"prompt", "answer", "level"}
    assert splits.train[3]["prompt"] == "3+1=" and str(splits.train[3]["answer"]) == "4"
    assert (splits.eval is not None) == (form in ("saved", "builder"))


def test_python_dataset_and_conversational_prompts():
    train = datasets.Dataset.from_list(_rows(8, conversational=True))
    held = datasets.Dataset.from_list(_rows(4, 50, conversational=True))
    splits = open_splits(train, held)
    assert splits.train[0]["prompt"] == [{"role": "user", "content": "0+1="}]
    assert len(splits.eval) == 4
    both = open_splits(datasets.DatasetDict({"train": train, "test": held}))
    assert len(both.eval) == 4, "a DatasetDict's `test` split is the evaluation rows"


def test_held_out_rows_are_disjoint_and_the_same_whatever_the_seed(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(100))
    a = open_splits(DatasetConfig(path=str(path), eval_size=20))
    b = open_splits({"path": str(path), "eval_size": 0.2})
    assert len(a.train) == 80 and len(a.eval) == 20
    assert list(a.eval.dataset["prompt"]) == list(b.eval.dataset["prompt"])
    assert not set(a.train.dataset["prompt"]) & set(a.eval.dataset["prompt"])
    assert sorted(list(a.train.dataset["prompt"]) + list(a.eval.dataset["prompt"])) == sorted(
        r["prompt"] for r in _rows(100)
    )


def test_training_rows_that_are_also_evaluation_rows_are_dropped(caplog):
    train = datasets.Dataset.from_list(_rows(10))
    held = datasets.Dataset.from_list(_rows(3, 8))  # 8 and 9 are training prompts too
    with caplog.at_level(logging.WARNING, logger="earl_lightning"):
        splits = open_splits(train, held)
    assert len(splits.train) == 8 and "8+1=" not in splits.train.dataset["prompt"]
    assert "2 training rows" in caplog.text
    assert prompt_key([{"role": "user", "content": "a"}]) == prompt_key(
        [{"content": "a", "role": "user"}]
    )


def test_row_order_is_a_pure_function_of_seed_and_position():
    order = RowOrder(7, seed=3)
    stream = [order[k] for k in range(21)]
    for epoch in range(3):
        assert sorted(stream[7 * epoch : 7 * epoch + 7]) == list(range(7)), (
            "each epoch visits every row once"
        )
    assert stream[:7] != stream[7:14], "each epoch has its own order"
    again = RowOrder(7, seed=3)
    assert [again[k] for k in (20, 0, 13)] == [stream[20], stream[0], stream[13]], (
        "random access = the stream"
    )
    assert [RowOrder(7, seed=4)[k] for k in range(7)] != stream[:7]
    assert np.isclose(order.epoch_of(14), 2.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(path=""), r"`--data.dataset.path` must be a hub id"),
        (
            dict(path="x", eval_size=1.5),
            r"`--data.dataset.eval_size` must be a count >= 0 or a share in \(0, 1\), got 1.5",
        ),
        (dict(path="x", eval_size=-1), r"`--data.dataset.eval_size` must be a count"),
        (
            dict(path="x", eval_split="test", eval_size=10),
            r"`--data.dataset.eval_split` \('test'\) and "
            r"`--data.dataset.eval_size` \(10\) both give",
        ),
        (
            dict(path="x", eval_split="train"),
            r"`--data.dataset.eval_split` is the training split 'train'",
        ),
        (dict(path="x", train_split=""), r"`--data.dataset.train_split` must be a split name"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DatasetConfig(**kwargs)


def test_bad_data_is_one_line(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^`--data.dataset` '.*nope.jsonl': cannot load the dataset \(no such "
        r"local file or directory; and not a hub id reachable from here\): ",
    ):
        open_splits(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match=r"^`--data.dataset.path` '.*nope.jsonl': cannot load"):
        open_splits({"path": str(tmp_path / "nope.jsonl")})
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(
        ValueError, match=r"has no `prompt` column; its columns: \['answer', 'question'\]"
    ):
        open_splits(str(path))
    with pytest.raises(
        ValueError,
        match=r"`--data.dataset.eval_split` 'test' is not a split of .*; its splits: "
        r"\['train'\]",
    ):
        open_splits({"path": str(path), "eval_split": "test"})
    empty = datasets.Dataset.from_dict({"prompt": []})
    with pytest.raises(
        ValueError,
        match=r"^`--data.dataset` \(the given Dataset\) has no rows: it needs at least one, with "
        r"`prompt`$",
    ):
        open_splits(empty)
    bad = datasets.Dataset.from_list([{"prompt": 7}])
    with pytest.raises(
        ValueError,
        match=r"row 0: `prompt` must be a string \(standard form\) or a list of messages",
    ):
        open_splits(bad)
    odd = datasets.Dataset.from_list([{"prompt": [{"role": "robot", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"message 0: role 'robot' is not one of"):
        open_splits(odd)
    with pytest.raises(
        ValueError, match=r"`--data.dataset.eval_size` 10 holds out 10 of the 10 training rows"
    ):
        open_splits({"path": str(_write_jsonl(tmp_path / "e.jsonl", _rows(10))), "eval_size": 10})
    with pytest.raises(
        ValueError, match=r"`--data.dataset` must be a path or hub id, its settings"
    ):
        open_splits(3.5)


def test_a_dataset_file_is_opened_by_its_path_object_too(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(3))
    assert len(open_splits(Path(path)).train) == 3


def test_a_settings_file_given_as_the_dataset_says_where_settings_go(tmp_path):
    settings = tmp_path / "dataset.yaml"
    settings.write_text("path: data.jsonl\neval_size: 4\n")
    with pytest.raises(
        ValueError,
        match=r"^`--data.dataset` '.*dataset.yaml': cannot load the dataset \(a path names the data "
        r"itself: give its settings inline, `--data.dataset '\{path: ..., eval_size: 0.1\}'`, or "
        r"under data.dataset in a --config file\): ",
    ):
        open_splits(str(settings))


def test_an_empty_file_is_one_line_naming_the_argument_and_the_file(tmp_path):
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    good = _write_jsonl(tmp_path / "good.jsonl", _rows(3))
    for given, arg in (
        (str(empty), "--data.dataset"),
        ({"path": str(blank)}, "--data.dataset.path"),
    ):
        with pytest.raises(ValueError) as err:
            open_splits(given)
        assert str(err.value) == (
            f"`{arg}` {str(given if isinstance(given, str) else blank)!r} is an empty file: the "
            "dataset needs at least one row, with `prompt`; write rows into it or name another file"
        )
    files = {"train": str(good), "test": str(empty)}
    with pytest.raises(
        ValueError,
        match=r"^`--data.dataset.data_files` '.*empty.jsonl' \(split 'test'\) is an empty file: the "
        r"dataset needs at least one row, with `prompt` \+ `completion` or `messages`",
    ):
        open_splits(
            {"path": "json", "data_files": files, "eval_split": "test"},
            required=(("prompt", "completion"), ("messages",)),
            check_row=check_sft_row,
        )


def _with_bad_row(tmp_path, n: int, bad: int, prompt) -> Path:
    rows = _rows(n, conversational=not isinstance(prompt, (str, type(None))))
    rows[bad]["prompt"] = prompt
    return _write_jsonl(tmp_path / "d.jsonl", rows)


def test_every_row_is_checked_when_first_read_and_named_by_its_row_in_the_file(tmp_path):
    path = _with_bad_row(tmp_path, 100, 90, None)
    splits = open_splits(str(path))  # only the first rows are read at start
    assert [splits.train[i]["prompt"] for i in range(90)] == [f"{i}+1=" for i in range(90)]
    with pytest.raises(BadRowError) as err:
        splits.train[90]
    assert isinstance(err.value, EarlError) and isinstance(err.value, ValueError)
    assert str(err.value) == (
        f"`--data.dataset` {str(path)!r}, row 90: `prompt` must be a string (standard form) or a "
        "list of messages (conversational form), got NoneType None; fix or remove that row"
    )
    # rows held out or dropped before: still the file's row number, whichever split it landed in
    path = _with_bad_row(tmp_path, 200, 190, None)
    held = open_splits({"path": str(path), "eval_size": 0.5})
    (part, at), *_ = [
        (part, i)
        for part in (held.train, held.eval)
        for i in range(len(part))
        if part.dataset[i]["prompt"] is None
    ]
    assert at != 190
    with pytest.raises(BadRowError, match=r"^`--data.dataset.path` '.*', row 190: `prompt`"):
        part[at]


def test_an_unknown_role_is_refused_naming_the_allowed_ones(tmp_path):
    path = _with_bad_row(tmp_path, 70, 66, [{"role": "robot", "content": "hi"}])
    splits = open_splits(str(path))
    with pytest.raises(
        BadRowError,
        match=r"^`--data.dataset` '.*', row 66: `prompt`, message 0: role 'robot' is not one of "
        r"\['system', 'user', 'assistant', 'tool'\]; fix or remove that row$",
    ):
        splits.train[66]


def test_a_row_is_checked_once(tmp_path):
    seen: list[str] = []

    def counting(row, where):
        seen.append(where)
        check_rl_row(row, where)

    splits = open_splits(datasets.Dataset.from_list(_rows(80)), check_row=counting)
    assert len(seen) == 64, "the first rows are checked at start"
    for _ in range(2):
        list(splits.train)
        splits.train[70]
    assert len(seen) == 80 and len(set(seen)) == 80
    assert seen[-1] == "`--data.dataset` (the given Dataset), row 79"


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"prompt": "2+3=", "completion": None},
            r"row 70: `prompt` and `completion` must both be strings \(standard form\) or both "
            r"lists of messages \(conversational form\), got str and NoneType",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            r"row 70: `messages` has no assistant message: nothing to train on",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "5"}]},
            r"row 70: `messages`, message 1: role 'bot' is not one of",
        ),
    ],
)
def test_sft_rows_are_checked_in_either_form(row, message):
    good = (
        {"prompt": "1+1=", "completion": "2"}
        if "prompt" in row
        else {
            "messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
        }
    )
    rows = [good] * 80
    rows[70] = row
    splits = open_splits(
        datasets.Dataset.from_list(rows),
        required=(("prompt", "completion"), ("messages",)),
        check_row=check_sft_row,
    )
    with pytest.raises(BadRowError, match=message):
        list(splits.train)

"""The DataModule over a prompt dataset: batch k is a pure function of (seed, k), a group plays one
row, every epoch visits each training row once, and no evaluation row is ever trained on."""

from __future__ import annotations

import datasets
import pytest

from earl_lightning.modules.datamodule import EpisodeDataModule

EXACT = "tests.plugins.rewards.exact_sum"


def _rows(n, start=0):
    return datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)}
            for i in range(start, start + n)
        ]
    )


def _dm(**kw):
    kw = (
        dict(
            dataset=_rows(10),
            eval_dataset=_rows(6, 100),
            reward_funcs=[EXACT],
            batch_size=8,
            group_size=4,
            eval_episodes=4,
        )
        | kw
    )
    return EpisodeDataModule(**kw)


def _prompts(specs):
    return [s.row["prompt"][0]["content"] for s in specs]


def test_batches_are_a_pure_function_of_seed_and_step():
    a, b = _dm(seed=1)._stream(0), _dm(seed=1)._stream(5)
    assert [_prompts(a.batch(k)) for k in range(5, 9)] == [
        _prompts(b.batch(k)) for k in range(5, 9)
    ]
    assert _prompts(_dm(seed=2)._stream(0).batch(0)) != _prompts(a.batch(0))
    specs = a.batch(0)
    assert [s.group_id for s in specs] == [0] * 4 + [1] * 4
    assert len(set(_prompts(specs[:4]))) == 1 and len({s.seed for s in specs[:4]}) == 1, (
        "a group plays one row"
    )
    assert specs[0].row_index != specs[4].row_index and specs[0].env is None


def test_epochs_visit_every_training_row_once_and_never_an_evaluation_row():
    dm = _dm(dataset=_rows(12), eval_dataset=_rows(4, 10))  # rows 10 and 11 are evaluation rows too
    train = [
        p for k in range(10) for p in _prompts(dm._stream(0).batch(k))[::4]
    ]  # 20 groups: 2 epochs of 10
    assert sorted(train[:10]) == sorted(train[10:]) == sorted(f"{i}+1=" for i in range(10))
    evaluated = _prompts(next(iter(dm.eval_batches()))["specs"])
    assert evaluated == ["10+1=", "11+1=", "12+1=", "13+1="] and not set(evaluated) & set(train)


def test_held_out_rows_of_a_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    _rows(50).to_json(str(path))
    dm = EpisodeDataModule(
        dataset={"path": str(path), "eval_size": 10},
        reward_funcs=[EXACT],
        batch_size=4,
        group_size=2,
        eval_episodes=100,
    )
    held = _prompts(next(iter(dm.eval_batches()))["specs"])
    train = {p for k in range(40) for p in _prompts(dm._stream(0).batch(k))}
    assert len(held) == 10 and len(train) == 40 and not set(held) & train
    assert dm.hparams.dataset == {"path": str(path), "eval_size": 10}


def test_without_evaluation_rows_there_is_no_evaluation():
    dm = _dm(eval_dataset=None)
    assert dm.eval_episodes == 0 and next(iter(dm.eval_batches()))["specs"] == []


def test_saved_hyperparameters_are_plain_data():
    dm = _dm()
    assert dm.hparams.dataset == "<Dataset 10>" and dm.hparams.reward_funcs == [EXACT]
    assert dm.hparams.eval_dataset == "<Dataset 6>"


def test_seed_tasks_are_unchanged_by_the_row_machinery():
    dm = EpisodeDataModule(batch_size=4, group_size=2)
    specs = dm._stream(0).batch(0)
    assert dm.env == "connect_four" and all(s.row is None and s.row_index == -1 for s in specs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reward_funcs=None), r"`--data.reward_funcs` is empty, and `--data.env` is null"),
        (
            dict(
                reward_funcs=["tests.plugins.rewards.exact_sum"],
                dataset=datasets.Dataset.from_list([{"prompt": "1+1=", "solution": "2"}]),
                eval_dataset=None,
            ),
            r"'exact_sum' needs \['answer'\]",
        ),
        (dict(reward_funcs=[3]), r"`--data.reward_funcs\[0\]` is int 3, not callable"),
    ],
)
def test_bad_tasks_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _dm(**kwargs)

"""Prompt datasets: anything ``datasets.load_dataset`` opens (a hub id, local jsonl / json /
parquet / csv files, a directory saved with ``save_to_disk``), or a ``datasets.Dataset`` given
in Python; a training split and an evaluation split that never share a row; and the order the
training rows are visited in, a pure function of ``(seed, epoch)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from earl_lightning.checks import is_int
from earl_lightning.tasks.rows import check_messages, check_prompt

log = logging.getLogger("earl_lightning.tasks")

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# rows whose prompt form is checked when a dataset is opened (all of them: at use)
_CHECKED_ROWS = 64
HOLDOUT_SEED = 0  # the held-out rows of `eval_size` are the same whatever the run's seed


@dataclass(frozen=True)
class DatasetConfig:
    """Where the rows come from (``datasets.load_dataset`` reads them).

    Args:
        path: a hub id (``openai/gsm8k``), a local file (``.jsonl``, ``.json``, ``.parquet``,
            ``.csv``), a directory written by ``save_to_disk``, or a builder name (``json``,
            ``parquet``, ``csv``) with ``data_files``.
        name: the dataset's configuration name (``load_dataset(path, name)``), e.g. ``main``.
        data_files: files of a builder, a path or list of paths, or ``{split: paths}``.
        train_split: the split the training rows come from.
        eval_split: the split the evaluation rows come from; null: ``eval_size`` rows are held out
            of ``train_split`` instead.
        eval_size: with no ``eval_split``: rows held out of ``train_split`` for evaluation, a count
            (``200``) or a share (``0.1``); the same rows whatever the run's seed. 0: no evaluation.
    """

    path: str
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    train_split: str = "train"
    eval_split: str | None = None
    eval_size: int | float = 0

    def __post_init__(self) -> None:
        arg = "--data.dataset"
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(
                f"`{arg}.path` must be a hub id, a local file or directory, or a builder name; "
                f"got {self.path!r}"
            )
        for name in ("train_split", "eval_split"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"`{arg}.{name}` must be a split name such as 'train' or 'test', got {value!r}"
                )
        s = self.eval_size
        if not ((is_int(s) and s >= 0) or (isinstance(s, float) and 0 < s < 1)):
            raise ValueError(
                f"`{arg}.eval_size` must be a count >= 0 or a share in (0, 1), got {s!r}"
            )
        if self.eval_split is not None and s:
            raise ValueError(
                f"`{arg}.eval_split` ({self.eval_split!r}) and `{arg}.eval_size` ({s!r}) both give the "
                f"evaluation rows; set one"
            )
        if self.eval_split is not None and self.eval_split == self.train_split:
            raise ValueError(
                f"`{arg}.eval_split` is the training split {self.train_split!r}: evaluation rows must "
                f"never be trained on; name another split, or hold rows out with `{arg}.eval_size`"
            )


def load_dataset_splits(config: DatasetConfig, arg: str = "--data.dataset") -> dict[str, Any]:
    """``{split name: datasets.Dataset}`` of ``config.path``; one clear line when it cannot be opened."""
    import datasets

    path = Path(config.path).expanduser()
    try:
        if path.is_dir() and (
            (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
        ):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file() and path.suffix in _FILE_BUILDERS:
            loaded = datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path))
        else:
            loaded = datasets.load_dataset(config.path, config.name, data_files=config.data_files)
    except Exception as err:  # noqa: BLE001 - whatever `datasets` raises, the user sees one line naming the path
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        hint = (
            ""
            if path.exists()
            else " (no such local file or directory; and not a hub id reachable from here)"
        )
        raise ValueError(
            f"`{arg}.path` {config.path!r}: cannot load the dataset{hint}: "
            f"{type(err).__name__}: {first[:200]}"
        ) from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


@dataclass
class Splits:
    """The training rows and the evaluation rows, disjoint (``datasets.Dataset`` objects)."""

    train: Any
    eval: Any | None
    source: str  # how the user named the data, for messages

    def columns(self) -> list[str]:
        return list(self.train.column_names)


def open_splits(
    dataset: Any,
    eval_dataset: Any = None,
    arg: str = "--data.dataset",
    required: Sequence[Sequence[str]] = (("prompt",),),
) -> Splits:
    """The train and evaluation rows of ``dataset`` (a :class:`DatasetConfig`, its mapping, a path
    string, a ``datasets.Dataset`` or ``DatasetDict``) and the optional ``eval_dataset`` (Python API).

    ``required``: alternatives of column sets the rows must have (``(("prompt",),)`` for RL;
    ``(("prompt", "completion"), ("messages",))`` for SFT). Rows of the evaluation split whose
    prompt is also a training prompt are dropped from the training rows (and counted in a log line),
    so the two never share a row.
    """
    import datasets

    if isinstance(dataset, datasets.Dataset):
        train, held, source = dataset, eval_dataset, "the given Dataset"
    elif isinstance(dataset, datasets.DatasetDict):
        config = DatasetConfig(
            path="<DatasetDict>",
            eval_split=None
            if eval_dataset is not None
            else ("test" if "test" in dataset else None),
        )
        train, held, source = (
            _split(dict(dataset), config, arg),
            eval_dataset,
            "the given DatasetDict",
        )
        if held is None and config.eval_split is not None:
            held = dataset[config.eval_split]
    else:
        config = _as_config(dataset, arg)
        splits = load_dataset_splits(config, arg)
        train, source = _split(splits, config, arg), repr(config.path)
        held = (
            eval_dataset
            if eval_dataset is not None
            else (splits[config.eval_split] if config.eval_split else None)
        )
        if config.eval_size:
            train, held = _hold_out(train, config.eval_size, arg)
    for split, rows in (("training", train), ("evaluation", held)):
        if rows is not None:
            _check_rows(rows, f"{arg} {source}, {split} split", required)
    if held is not None:
        train = _without_shared(train, held, source)
    return Splits(train, held, source)


def _as_config(dataset: Any, arg: str) -> DatasetConfig:
    from earl_lightning.groups import coerce

    if isinstance(dataset, str):
        return DatasetConfig(path=dataset)
    if dataset is None:
        raise ValueError(f"`{arg}` is required: a path, a hub id, or a datasets.Dataset")
    if not isinstance(dataset, (DatasetConfig, dict)):
        raise ValueError(
            f"`{arg}` must be a path or hub id, its settings ({{path: ..., eval_split: ...}}), or a "
            f"datasets.Dataset / DatasetDict; got {type(dataset).__name__}"
        )
    return coerce(DatasetConfig, dataset, arg)


def _split(splits: dict[str, Any], config: DatasetConfig, arg: str) -> Any:
    for name in filter(None, (config.train_split, config.eval_split)):
        if name not in splits:
            which = "train_split" if name == config.train_split else "eval_split"
            raise ValueError(
                f"`{arg}.{which}` {name!r} is not a split of {config.path!r}; its splits: "
                f"{sorted(splits)}"
            )
    return splits[config.train_split]


def _hold_out(train: Any, size: int | float, arg: str) -> tuple[Any, Any]:
    n = len(train)
    k = int(round(size * n)) if isinstance(size, float) else size
    if k >= n:
        raise ValueError(
            f"`{arg}.eval_size` {size!r} holds out {k} of the {n} training rows; at least one must "
            f"stay for training"
        )
    order = np.random.default_rng(HOLDOUT_SEED).permutation(n)
    return train.select(np.sort(order[k:])), train.select(np.sort(order[:k]))


def _check_rows(rows: Any, where: str, required: Sequence[Sequence[str]]) -> None:
    if len(rows) == 0:
        raise ValueError(f"`{where}` is empty: it has no rows")
    cols = set(rows.column_names)
    if not any(set(option) <= cols for option in required):
        need = " or ".join("`" + "` + `".join(option) + "`" for option in required)
        raise ValueError(
            f"`{where}` has no {need} column; its columns: {sorted(cols)}. Rename a column with "
            f"Dataset.rename_column, or map the rows into that form"
        )
    head = rows.select(range(min(len(rows), _CHECKED_ROWS)))
    for i, row in enumerate(head):
        if "prompt" in row:
            check_prompt(row["prompt"], f"{where}, row {i}")
        elif "messages" in row:
            check_messages(row["messages"], f"{where}, row {i}: `messages`")


def prompt_key(prompt: Any) -> str:
    """A stable digest of a prompt (either form), to find rows the two splits share."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()


def _without_shared(train: Any, held: Any, source: str) -> Any:
    column = (
        "prompt" if "prompt" in held.column_names and "prompt" in train.column_names else "messages"
    )
    if column not in held.column_names or column not in train.column_names:
        return train
    held_keys = {prompt_key(p) for p in held[column]}
    keep = [i for i, p in enumerate(train[column]) if prompt_key(p) not in held_keys]
    if len(keep) == len(train):
        return train
    if not keep:
        raise ValueError(
            f"every training row of {source} is also an evaluation row; evaluation rows are never "
            f"trained on, so nothing is left to train"
        )
    log.warning(
        "%d training rows of %s have a prompt that is also an evaluation row's: they are not trained on",
        len(train) - len(keep),
        source,
    )
    return train.select(keep)


class RowOrder:
    """The training rows in epochs: every epoch visits each row once, in an order drawn from
    ``(seed, epoch)``; position ``k`` of the whole stream is a pure function of ``(seed, k)``."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows, self.seed = num_rows, seed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def __getitem__(self, k: int) -> int:
        epoch, pos = divmod(k, self.num_rows)
        if epoch != self._epoch:
            self._epoch, self._perm = (
                epoch,
                np.random.default_rng([self.seed, epoch]).permutation(self.num_rows),
            )
        return int(self._perm[pos])

    def epoch_of(self, k: int) -> float:
        return k / self.num_rows


def describe(value: Any) -> Any:
    """A data setting as plain data for saved hyperparameters: a Dataset by its size, a callable by
    its import path, a :class:`DatasetConfig` as a dict; plain values as they are."""
    from dataclasses import asdict

    import datasets

    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    if isinstance(value, DatasetConfig):
        return asdict(value)
    if isinstance(value, (datasets.Dataset, datasets.DatasetDict)):
        return f"<{type(value).__name__} {value.num_rows}>"
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"

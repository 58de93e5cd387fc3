"""Prompt datasets: anything ``datasets.load_dataset`` opens (a hub id, local jsonl / json /
parquet / csv files, a directory saved with ``save_to_disk``), or a ``datasets.Dataset`` given
in Python; a training split and an evaluation split that never share a row; and the order the
training rows are visited in, a pure function of ``(seed, epoch)``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from earl_lightning.core import console
from earl_lightning.core.checks import is_int
from earl_lightning.tasks.rows import BadRowError, check_rl_row

_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
# rows checked when a dataset is opened (a wrong form fails before anything runs); every other row
# is checked when it is first read
_CHECKED_ROWS = 64
RowCheck = Callable[[dict[str, Any], str], None]
HOLDOUT_SEED = 0  # the held-out rows of `eval_size` are the same whatever the run's seed


@dataclass(frozen=True)
class DatasetConfig:
    """Where the rows come from (``datasets.load_dataset`` reads them).

    Args:
        path: a hub id (``openai/gsm8k``), a local file (``.jsonl``, ``.json``, ``.parquet``,
            ``.csv``, ``.arrow``), a directory written by ``save_to_disk``, or a builder name
            (``json``, ``parquet``, ``csv``) with ``data_files``.
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


def load_dataset_splits(
    config: DatasetConfig, arg: str = "--data.dataset", path_arg: str | None = None
) -> dict[str, Any]:
    """``{split name: datasets.Dataset}`` of ``config.path``; one clear line when it cannot be
    opened. ``path_arg``: the argument as the user wrote the path (``--data.dataset`` for a bare
    path; ``--data.dataset.path`` by default)."""
    import datasets

    path_arg = path_arg or f"{arg}.path"
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
        differ = _split_columns_differ(config, arg)
        if differ is not None:
            raise ValueError(differ) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if isinstance(err, StopIteration):  # `datasets`' json builder on a file with no row
            first = "no row found (an empty file?)"
        hint = (
            ""
            if path.exists() or config.data_files is not None
            else " (no such local file or directory; and not a hub id reachable from here)"
        )
        if path.suffix in (".yaml", ".yml"):  # a path is always the data, never its settings
            hint = (
                f" (a path names the data itself: give its settings inline, `{arg} '{{path: ..., "
                f"eval_size: 0.1}}'`, or under data.dataset in a --config file)"
            )
        raise ValueError(
            f"`{path_arg}` {config.path!r}: cannot load the dataset{hint}: "
            f"{type(err).__name__}: {first[:200]}"
        ) from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def _split_columns_differ(config: DatasetConfig, arg: str) -> str | None:
    """Why splits given as ``{split: files}`` cannot load together when each loads alone: their
    columns differ (``datasets`` says only ``DatasetGenerationError``). None: not that."""
    import datasets

    files = config.data_files
    if not isinstance(files, dict) or len(files) < 2:
        return None
    columns = {}
    for split, group in files.items():
        try:
            one = datasets.load_dataset(config.path, config.name, data_files={split: group})
        except Exception:  # noqa: BLE001 - this split is broken on its own: the first error says how
            return None
        columns[split] = sorted(one[split].column_names)
    if len({tuple(c) for c in columns.values()}) == 1:
        return None
    listed = ", ".join(f"{split!r} has {cols}" for split, cols in columns.items())
    return (
        f"`{arg}.data_files`: the splits' columns differ ({listed}); every split of one dataset "
        f"needs the same columns: write them in one form (`earl sft` plays an evaluation row in "
        f"the `messages` form from its first user turn)"
    )


def _refuse_empty_files(config: DatasetConfig, arg: str, path_arg: str, need: str) -> None:
    """A local data file with nothing in it is named in one line (``datasets`` answers
    ``StopIteration``, or a dataset with no rows)."""
    files = config.data_files
    named: dict[str, Any] = files if isinstance(files, dict) else {"": files}
    candidates = [(path_arg, config.path, "")] + [
        (f"{arg}.data_files", f, split)
        for split, group in named.items()
        for f in ([group] if isinstance(group, str) else group or [])
    ]
    for where, file, split in candidates:
        if isinstance(file, str) and _is_blank(Path(file).expanduser()):
            of = f" (split {split!r})" if split else ""
            raise ValueError(
                f"`{where}` {file!r}{of} is an empty file: the dataset needs at least one row, "
                f"with {need}; write rows into it or name another file"
            )


def _is_blank(path: Path) -> bool:
    """A regular file holding nothing but whitespace (read up to its first other byte)."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


class CheckedRows:
    """The rows of one split, each checked the first time it is read.

    A huge dataset costs no pass at start (a ``datasets.Dataset`` is read row by row at about
    30,000 rows a second here: a million rows would wait half a minute), yet no row reaches an
    episode or a tokenizer unchecked, and none is checked twice. A bad row is one
    :class:`BadRowError` line naming ``label`` (the argument, the file, the split) and the row's
    index in the split as loaded (``row 90`` is a file's 91st row), whatever was held out or
    dropped before.
    """

    def __init__(
        self, rows: Any, label: str, check: RowCheck, numbers: np.ndarray | None = None
    ) -> None:
        self.dataset, self.label, self.check = rows, label, check
        self.numbers = np.arange(len(rows)) if numbers is None else numbers
        self._checked = np.zeros(len(rows), dtype=bool)

    @property
    def column_names(self) -> list[str]:
        """The split's columns (read from the dataset's schema: no row is read or checked)."""
        return list(self.dataset.column_names)

    def __len__(self) -> int:
        return len(self.dataset)

    def where(self, i: int) -> str:
        """Row ``i`` as a message names it."""
        return f"{self.label}, row {int(self.numbers[i])}"

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.dataset[int(i)]
        if not self._checked[i]:
            try:
                self.check(row, self.where(i))
            except ValueError as err:
                raise BadRowError(f"{err}; fix or remove that row") from None
            self._checked[i] = True
        return row

    def check_first(self, n: int) -> None:
        """Check the first ``n`` rows now (a dataset whose every row is wrong fails at start)."""
        for i in range(min(n, len(self))):
            self[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def select(self, indices: Sequence[int]) -> CheckedRows:
        """These rows at ``indices`` (what is known checked stays checked)."""
        idx = np.asarray(indices, dtype=np.int64)
        out = CheckedRows(self.dataset.select(idx), self.label, self.check, self.numbers[idx])
        out._checked = self._checked[idx]
        return out


@dataclass
class Splits:
    """The training rows and the evaluation rows, disjoint, each checked when first read."""

    train: CheckedRows
    eval: CheckedRows | None
    source: str  # how the user named the data, for messages

    def columns(self) -> list[str]:
        """The training rows' columns, which reward functions and agents may ask for by name."""
        return list(self.train.column_names)


def open_splits(
    dataset: Any,
    eval_dataset: Any = None,
    arg: str = "--data.dataset",
    required: Sequence[Sequence[str]] = (("prompt",),),
    check_row: RowCheck = check_rl_row,
) -> Splits:
    """The train and evaluation rows of ``dataset`` (a :class:`DatasetConfig`, its mapping, a path
    string or ``os.PathLike``, a ``datasets.Dataset`` or ``DatasetDict``) and the optional
    ``eval_dataset`` (Python API).

    ``required``: alternatives of column sets the rows must have (``(("prompt",),)`` for RL;
    ``(("prompt", "completion"), ("messages",))`` for SFT); ``check_row(row, where)``: what one
    row must be (raises ValueError), run on the first rows now and on every other when first read.
    Rows of the evaluation split whose prompt is also a training prompt are dropped from the
    training rows (and counted in a log line), so the two never share a row.
    """
    import datasets

    given_eval = (
        None
        if eval_dataset is None
        else CheckedRows(eval_dataset, "`eval_dataset` (the given Dataset)", check_row)
    )
    if isinstance(dataset, datasets.Dataset):
        source = "the given Dataset"
        train, held = CheckedRows(dataset, f"`{arg}` ({source})", check_row), given_eval
    elif isinstance(dataset, datasets.DatasetDict):
        config = DatasetConfig(
            path="<DatasetDict>",
            eval_split=None
            if eval_dataset is not None
            else ("test" if "test" in dataset else None),
        )
        source = "the given DatasetDict"
        train, held = _loaded_splits(dict(dataset), config, f"`{arg}` ({source})", arg, check_row)
        held = given_eval if given_eval is not None else held
    else:
        config = _as_config(dataset, arg)
        named = arg if isinstance(dataset, (str, os.PathLike)) else f"{arg}.path"
        _refuse_empty_files(config, arg, named, _needed(required))
        splits = load_dataset_splits(config, arg, named)
        source = repr(config.path)
        train, held = _loaded_splits(splits, config, f"`{named}` {source}", arg, check_row)
        held = given_eval if given_eval is not None else held
        if config.eval_size:
            train, held = _hold_out(train, config.eval_size, arg)
    for rows in (train, held):
        if rows is not None:
            _check_rows(rows, required)
    if held is not None:
        train = _without_shared(train, held, source)
    return Splits(train, held, source)


def _as_config(dataset: Any, arg: str) -> DatasetConfig:
    from earl_lightning.core.config_groups import coerce

    if isinstance(dataset, (str, os.PathLike)):
        return DatasetConfig(path=os.fspath(dataset))
    if dataset is None:
        raise ValueError(f"`{arg}` is required: a path, a hub id, or a datasets.Dataset")
    if not isinstance(dataset, (DatasetConfig, dict)):
        raise ValueError(
            f"`{arg}` must be a path or hub id, its settings ({{path: ..., eval_split: ...}}), or a "
            f"datasets.Dataset / DatasetDict; got {type(dataset).__name__}"
        )
    return coerce(DatasetConfig, dataset, arg)


def _loaded_splits(
    splits: dict[str, Any], config: DatasetConfig, source: str, arg: str, check_row: RowCheck
) -> tuple[CheckedRows, CheckedRows | None]:
    """The training split and the evaluation split (None without ``eval_split``), named in
    messages by ``source`` and, when there are several, by their split names."""
    for name in filter(None, (config.train_split, config.eval_split)):
        if name not in splits:
            which = "train_split" if name == config.train_split else "eval_split"
            raise ValueError(
                f"`{arg}.{which}` {name!r} is not a split of {config.path!r}; its splits: "
                f"{sorted(splits)}"
            )

    def rows(name: str) -> CheckedRows:
        where = source if len(splits) == 1 else f"{source}, split {name!r}"
        return CheckedRows(splits[name], where, check_row)

    return rows(config.train_split), rows(config.eval_split) if config.eval_split else None


def _hold_out(train: CheckedRows, size: int | float, arg: str) -> tuple[CheckedRows, CheckedRows]:
    n = len(train)
    k = int(round(size * n)) if isinstance(size, float) else size
    if k >= n:
        raise ValueError(
            f"`{arg}.eval_size` {size!r} holds out {k} of the {n} training rows; at least one must "
            f"stay for training"
        )
    order = np.random.default_rng(HOLDOUT_SEED).permutation(n)
    return train.select(np.sort(order[k:])), train.select(np.sort(order[:k]))


def _needed(required: Sequence[Sequence[str]]) -> str:
    return " or ".join("`" + "` + `".join(option) + "`" for option in required)


def _check_rows(rows: CheckedRows, required: Sequence[Sequence[str]]) -> None:
    need = _needed(required)
    if len(rows) == 0:
        raise ValueError(f"{rows.label} has no rows: it needs at least one, with {need}")
    cols = set(rows.column_names)
    if not any(set(option) <= cols for option in required):
        raise ValueError(
            f"{rows.label} has no {need} column; its columns: {sorted(cols)}. Rename a column with "
            f"Dataset.rename_column, or map the rows into that form"
        )
    rows.check_first(_CHECKED_ROWS)


def prompt_key(prompt: Any) -> str:
    """A stable digest of a prompt (either form), to find rows the two splits share."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()


def _without_shared(train: CheckedRows, held: CheckedRows, source: str) -> CheckedRows:
    column = (
        "prompt" if "prompt" in held.column_names and "prompt" in train.column_names else "messages"
    )
    if column not in held.column_names or column not in train.column_names:
        return train
    held_keys = {prompt_key(p) for p in held.dataset[column]}
    keep = [i for i, p in enumerate(train.dataset[column]) if prompt_key(p) not in held_keys]
    if len(keep) == len(train):
        return train
    if not keep:
        raise ValueError(
            f"every training row of {source} is also an evaluation row; evaluation rows are never "
            f"trained on, so nothing is left to train"
        )
    console.warn(
        f"{len(train) - len(keep)} training rows of {source} have a prompt that is also an "
        "evaluation row's: they are not trained on"
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
        """How many epochs position ``k`` of the stream is into the rows (fractional)."""
        return k / self.num_rows


def describe(value: Any) -> Any:
    """A data setting as plain data for saved hyperparameters: a Dataset by its size, a callable by
    its import path, a :class:`DatasetConfig` as a dict; plain values as they are."""
    from dataclasses import asdict

    import datasets

    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, DatasetConfig):
        return asdict(value)
    if isinstance(value, (datasets.Dataset, datasets.DatasetDict)):
        return f"<{type(value).__name__} {value.num_rows}>"
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"

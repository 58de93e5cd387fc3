"""The loaders a checkpoint is read through, none of which can run code: what a file brings is data
and tensors, whatever its pickles name.

A distributed (DCP) checkpoint directory holds two kinds of pickles torch would unpickle with a
plain unpickler: its ``.metadata`` and, in its shards, every non-tensor entry (an optimizer's
``lr``, ``betas``, ``params``...: DCP writes each with ``torch.save`` and its ``DefaultLoadPlanner``
reads it back with ``torch.load(weights_only=False)``). Here both are unpickled by unpicklers
that know only the types a real save writes (:class:`CheckedReader`, :class:`CheckedLoadPlanner`,
:func:`load_dcp`), so a planted pickle is refused, not run, whatever torch's defaults or
Lightning's arguments are. Single files are read with ``torch.load(weights_only=True)``, asked
for explicitly (an explicit ``True`` is one ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn off).

No Lightning here (tier 1).
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)

from earl_lightning.core.errors import CheckpointError

PathLike = Union[str, "os.PathLike[str]"]


def reason(err: BaseException) -> str:
    """``err`` in one line; of torch's weights-only unpickling error, the part that says what failed
    (not its advice to load the file with ``weights_only=False``)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    elif text.startswith("Weights only load failed"):
        text = text.split("\n\n", 1)[-1]
    line = " ".join(text.split("Check the documentation", 1)[0].split())
    if len(line) > 200:
        line = line[:200] + "..."
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def checkpoint_unreadable(path: PathLike, err: BaseException, arg: str = "") -> CheckpointError:
    """The error for a checkpoint file ``torch.load`` failed on (``err``): truncated or corrupt, or
    a pickle naming what a checkpoint never holds (a function: its load would have run code)."""
    where = f"`{arg}`: checkpoint {str(path)!r}" if arg else f"checkpoint {str(path)!r}"
    path = Path(path)
    if not path.exists():
        return CheckpointError(f"{where} does not exist")
    if path.is_file() and not zipfile.is_zipfile(path):
        return CheckpointError(
            f"{where} is truncated or not a checkpoint file ({path.stat().st_size:,} bytes, no "
            "end-of-archive record): its save or copy was interrupted? Use an earlier checkpoint"
        )
    refused = re.search(r"GLOBAL ([\w.]+)", str(err))
    if isinstance(err, pickle.UnpicklingError) and refused:
        return CheckpointError(
            f"{where} holds {refused.group(1)}, a type a checkpoint does not (the file was not "
            "written by a save); refused without running it"
        )
    return CheckpointError(
        f"{where} is corrupt or not a checkpoint: torch.load failed with {reason(err)}. "
        "Use an earlier checkpoint"
    )


def load_file(path: PathLike, mmap: bool = True) -> Any:
    """A checkpoint file as plain data and tensors (``weights_only=True``, asked for explicitly);
    a truncated, corrupt or planted file is one CheckpointError line."""
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read the file is the file's
        raise checkpoint_unreadable(path, err) from None


# ---- restricted unpicklers ----------------------------------------------------------------------


class RefusedType(pickle.UnpicklingError):
    """A checkpoint's pickle names a type no save writes there."""


class _Unpickler(pickle.Unpickler):
    """An unpickler that builds only the types ``allowed(module, name)`` admits (primitives,
    tuples, lists and dicts need no lookup) and no persistent objects (tensor storages)."""

    allowed: Callable[[str, str], bool]
    own_modules: tuple[str, ...] = ()

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) spells builtins as Python 2 did: named as pickle resolves them
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = super().find_class(module, name) if type(self).allowed(module, name) else None
        foreign = module in self.own_modules and (
            not isinstance(found, type) or found.__module__ != module
        )
        if found is None or foreign:  # a module's own classes only, not what it imports
            raise RefusedType(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedType("a tensor storage")


# What a DCP checkpoint's `.metadata` pickle may name: torch's own metadata classes, the sizes,
# dtypes and layouts of tensors, and the path it was saved to. Anything else (os.system, eval, a
# class of the user's) is a file that was not written by a save, and unpickling it would run code.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("pathlib._local", "PosixPath"),
}
# What a shard's non-tensor entry may name. A real save's (Lightning's ModelParallelStrategy under
# EarlStrategy: the optimizer's param groups, `lr`, `betas`, `eps`, `params`...) names none at all:
# floats, bools, None, strings, tuples and lists are pickle's own. The few containers and dtypes
# below are what an optimizer of the user's may add; never a function, never a tensor storage.
_ENTRY_NAMES = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
}


def _a_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _metadata_type(module: str, name: str) -> bool:
    if (module, name) in _METADATA_NAMES:
        return True
    if module in _METADATA_MODULES:
        return not name.startswith("__")
    return _a_dtype(module, name)


class _MetadataUnpickler(_Unpickler):
    allowed = staticmethod(_metadata_type)
    own_modules = _METADATA_MODULES


def _entry_type(module: str, name: str) -> bool:
    return (module, name) in _ENTRY_NAMES or _a_dtype(module, name)


class _EntryUnpickler(_Unpickler):
    allowed = staticmethod(_entry_type)


def _load_metadata(file: IO[bytes], where: str) -> Any:
    """The ``Metadata`` pickled in ``file`` (a DCP directory's ``.metadata``), or one line."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(file).load()
    except RefusedType as err:
        raise CheckpointError(
            f"{where}: its .metadata holds {err}, a type a checkpoint does not (the file was not "
            "written by a save); refused without running it"
        ) from None
    except Exception as err:  # noqa: BLE001 - any other failure to read the file is the file's
        raise CheckpointError(
            f"{where}: its .metadata cannot be read ({reason(err)}); "
            "the file is truncated or corrupt. Use an earlier checkpoint"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{where}: its .metadata holds a {type(metadata).__name__}, not a checkpoint's "
            "metadata; refused"
        )
    return metadata


def read_dcp_metadata(path: PathLike) -> Any:
    """The ``Metadata`` of the DCP checkpoint directory ``path``, unpickled with only the types a
    checkpoint's ``.metadata`` holds: a planted file is refused, not run."""
    where = f"checkpoint {str(path)!r}"
    try:
        with open(Path(path) / ".metadata", "rb") as f:
            return _load_metadata(f, where)
    except OSError as err:
        raise CheckpointError(f"{where}: its .metadata cannot be read ({reason(err)})") from None


def load_entry(value: IO[bytes], where: str, key: str) -> Any:
    """A shard's non-tensor entry ``key`` (a ``torch.save`` archive DCP wrote), unpickled with only
    the types such an entry holds; anything else is one CheckpointError line, never run."""
    try:
        with zipfile.ZipFile(value) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1:
                raise ValueError(f"{len(pickles)} data.pkl records")
            return _EntryUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
    except RefusedType as err:
        raise CheckpointError(
            f"{where}: its entry {key} holds {err}, which a checkpoint's non-tensor entries do not "
            "(the shard was not written by a save); refused without running it"
        ) from None
    except Exception as err:  # noqa: BLE001 - any other failure to read the entry is the file's
        raise CheckpointError(
            f"{where}: its entry {key} cannot be read ({reason(err)}); the shard is corrupt. "
            "Use an earlier checkpoint"
        ) from None


# ---- DCP: the reader, the planners, the load ----------------------------------------------------


class CheckedReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` (global or a rank's own) is read by the restricted
    unpickler (:func:`read_dcp_metadata`'s), not by torch's plain ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _load_metadata(f, f"checkpoint {str(self.path)!r}")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _EntriesAsData:
    """``load_bytes`` of a DCP load planner through :func:`load_entry` (torch's runs
    ``torch.load(weights_only=False)`` on what the shard holds)."""

    where: str

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        key = read_item.dest_index.fqn
        entry = load_entry(value, self.where, key)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], entry)
        else:
            self.state_dict[key] = entry


class CheckedLoadPlanner(_EntriesAsData, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (into the given state dict) whose non-tensor entries are data only."""

    def __init__(self, where: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where = where


class CheckedWholeLoadPlanner(_EntriesAsData, _EmptyStateDictLoadPlanner):
    """torch's planner that rebuilds the whole state dict from the metadata, its non-tensor
    entries data only."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where


def load_dcp(
    state: dict[str, Any], path: PathLike, *, whole: bool = False, partial: bool = False
) -> None:
    """Load the DCP directory ``path`` into ``state`` (in place: the tensors it holds, resharded
    as DCP does), or, ``whole``, into the empty ``state`` in this one process. Nothing read can
    run code. Any failure, on any rank, is one CheckpointError on every rank: a refused or
    unreadable entry's own, else the first rank's failure as the checkpoint's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    where = f"checkpoint {str(path)!r}"
    read_dcp_metadata(path)  # its own line (inside the load, DCP would bury it in another error)
    reader = CheckedReader(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if whole:
                planner = CheckedWholeLoadPlanner(where)
                _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
            else:
                planner = CheckedLoadPlanner(where, allow_partial_load=partial)
                dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as err:  # a BaseException: every rank's failure, gathered
        failures = [err.failures[rank][0] for rank in sorted(err.failures)]
        ours = [failure for failure in failures if isinstance(failure, CheckpointError)]
        raise (ours[0] if ours else checkpoint_unreadable(path, failures[0])) from None


def load_trainer_state(path: PathLike) -> dict[str, Any]:
    """A DCP directory's ``meta.pt`` (what Lightning saves beside the shards: the trainer's state)."""
    state = load_file(Path(path) / "meta.pt")
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its meta.pt holds a {type(state).__name__}, not the "
            "trainer's state"
        )
    return state

"""Checkpoint files: read with errors that name the file and what is wrong with it, checked against
the model they are loaded into, and written so that a crash or a full disk never costs the previous
one. Used by EarlStrategy and the `earl` command; no Lightning here."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import torch

from earl_lightning.checkpoints.loaders import load_file, read_dcp_metadata
from earl_lightning.checkpoints.urls import is_url
from earl_lightning.core.errors import CheckpointError, DiskFullError

PathLike = Union[str, "os.PathLike[str]"]


def read_checkpoint_shapes(path: PathLike) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a single-file checkpoint's ``state_dict``, read as data only
    (:func:`load_file`) without loading its tensors."""
    checkpoint = load_file(path)
    state = checkpoint.get("state_dict", {}) if isinstance(checkpoint, Mapping) else {}
    return {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}


def read_dcp_shapes(path: PathLike) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a distributed (DCP) checkpoint directory, after checking that its
    ``.metadata``, Lightning's ``meta.pt`` and every shard the metadata names are there in full."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{where} is not a complete distributed checkpoint: it has no .metadata "
            "(written last by a save: the save was interrupted?). Use an earlier checkpoint"
        )
    metadata = read_dcp_metadata(path)
    needs: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
    for name, need in sorted(needs.items()):
        if Path(name).name != name or name.startswith("."):
            raise CheckpointError(
                f"{where}: its .metadata names the shard {name!r}, not a file of its directory "
                "(the file was not written by a save); refused"
            )
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < need:
            have = "is missing" if size is None else f"has {size:,} bytes"
            raise CheckpointError(
                f"{where} is truncated: shard {name} {have}, its .metadata needs {need:,} bytes "
                "(an interrupted save or copy?). Use an earlier checkpoint"
            )
    if not (path / "meta.pt").is_file():
        raise CheckpointError(
            f"{where} is not a complete checkpoint: meta.pt (the trainer's state) is missing"
        )
    prefix = "state_dict."
    return {
        k[len(prefix) :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def newest_last_checkpoint(dirs: Iterable[PathLike]) -> Path | None:
    """The newest ``last*.ckpt`` (a file, or a DCP directory with its ``.metadata``) directly in
    one of ``dirs``, where the run's checkpoint callbacks write. A ``.last*.ckpt.old`` without its
    ``last*.ckpt`` is what a crash between the two renames of :func:`replace_dir` leaves: the
    previous checkpoint, whole, and the newest one there is."""
    found = []
    for folder in map(Path, dirs):
        for p in folder.glob("last*.ckpt"):
            found += [p] if _complete(p) else []
        for old in folder.glob(".last*.ckpt.old"):
            found += (
                [old]
                if _complete(old) and not _complete(folder / old.name[1 : -len(".old")])
                else []
            )
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _complete(path: Path) -> bool:
    return path.is_file() or (path / ".metadata").is_file()


def dcp_writers(path: PathLike) -> int:
    """How many processes wrote a distributed checkpoint directory (its ``__<rank>_*.distcp`` shards)."""
    return len({p.name.split("_")[2] for p in Path(path).glob("__*_*.distcp")})


def check_checkpoint_matches(
    path: PathLike,
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    strict: bool = True,
) -> None:
    """A checkpoint's parameter shapes (``found``) fit the model's (``expected``), or one line
    naming the checkpoint and the first difference."""
    where = f"checkpoint {str(path)!r} is from another model"
    hint = "(the model and the recipe must be those of the run that saved it)"
    for key, shape in expected.items():
        if key in found and tuple(found[key]) != tuple(shape):
            raise CheckpointError(
                f"{where}: {key} has shape {list(found[key])} there and {list(shape)} in this "
                f"model {hint}"
            )
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if strict and (missing or unexpected):
        parts = [
            f"{len(keys)} {what} key(s), e.g. {keys[:3]}"
            for what, keys in (("missing", missing), ("unexpected", unexpected))
            if keys
        ]
        raise CheckpointError(f"{where}: {'; '.join(parts)} {hint}")


def save_file_atomically(checkpoint: Mapping[str, Any], path: PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, flushed to disk, then renamed over it:
    a crash or a full disk mid-save leaves the previous file whole. (Lightning's own save stages
    the file in the system temp directory; on another filesystem its final move is a copy into
    ``path`` that a crash can cut short.)"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not named *.ckpt: Lightning's `ckpt_path="last"` must never pick up a partial file.
    tmp = path.with_name(f".{path.name}.partial{os.getpid()}")
    remove_stale_temporaries(path, "partial")
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def remove_stale_temporaries(path: Path, kind: str) -> None:
    """Remove the ``.<name>.<kind><pid>`` siblings of ``path`` whose process is gone: what a save
    killed mid-write left (a checkpoint-sized file). Those of a live process are its save in progress."""
    for tmp in path.parent.glob(f".{path.name}.{kind}*"):
        pid = tmp.name[len(f".{path.name}.{kind}") :]
        if pid.isdigit() and not _alive(int(pid)):
            remove_path(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def replace_dir(src: PathLike, dst: PathLike) -> None:
    """Move the complete checkpoint directory ``src`` to ``dst``, replacing what is there.

    A directory cannot be renamed over a non-empty one, so the old ``dst`` is moved aside first and
    deleted last: a crash between the two renames leaves it whole as ``.<name>.old``."""
    src, dst = Path(src), Path(dst)
    old = dst.with_name(f".{dst.name}.old")
    remove_path(old)
    if dst.exists() or dst.is_symlink():
        os.replace(dst, old)
    os.replace(src, dst)
    _fsync_dir(dst.parent)
    remove_path(old)


def write_dir_atomically(dst: PathLike, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` fills a temporary sibling of ``dst``, which then replaces ``dst``
    (:func:`replace_dir`): a crash or an error mid-write never leaves a half directory under the
    final name, and the previous ``dst`` stays whole until the new one is complete."""
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    remove_stale_temporaries(dst, "tmp")
    remove_path(tmp)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        # the files' data on disk before the rename makes them the directory
        for file in tmp.rglob("*"):
            if file.is_file():
                _fsync_file(file)
        replace_dir(tmp, dst)
    finally:
        remove_path(tmp)
    return dst


def output_dir_problem(
    output_dir: PathLike, overwrite: bool, arg: str, flag: str = "--overwrite"
) -> str | None:
    """Why the directory ``output_dir`` (given as ``arg``) cannot be written (None: it can): it is
    a file, or it holds something and ``overwrite`` (the option ``flag``) is off. Checked before
    any work."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        return f"`{arg}` {str(output_dir)!r} is a file; it must be a directory (new, empty, or with {flag})"
    if path.is_dir() and next(path.iterdir(), None) is not None and not overwrite:
        return (
            f"`{arg}` {str(output_dir)!r} exists and is not empty; pass {flag} to replace it, or "
            f"choose another directory"
        )
    return None


def overlap_problem(
    output_dir: PathLike, arg: str, kept: Iterable[tuple[PathLike | None, str]]
) -> str | None:
    """Why writing the directory ``output_dir`` (given as ``arg``), which replaces it whole, would
    delete what the command must keep (None: it would not): it is one of ``kept`` (a path and what
    it is, e.g. "the checkpoint read (`--ckpt_path` 'x')") or holds one. Paths are compared
    resolved (symbolic links followed); URLs and unset paths are skipped."""
    out = _resolved(output_dir)
    for path, what in kept:
        other = _resolved(path)
        if out is not None and other is not None and (out == other or out in other.parents):
            relation = "is" if out == other else "contains"
            return (
                f"`{arg}` {str(output_dir)!r} {relation} {what}; writing it replaces the whole "
                "directory: choose another"
            )
    return None


def inside_problem(path: PathLike, arg: str, checkpoint: PathLike | None, what: str) -> str | None:
    """Why ``path`` (given as ``arg``), a directory a command writes into, may not be where it is:
    it is, or lies inside, the distributed (DCP) checkpoint directory ``checkpoint`` the command
    reads (``what``), which is the checkpoint whole (a save replaces it). None: it may be."""
    inner, outer = _resolved(path), _resolved(checkpoint) if is_dcp_dir(checkpoint) else None
    if inner is None or outer is None or (inner != outer and outer not in inner.parents):
        return None
    relation = "is" if inner == outer else "is inside"
    return f"`{arg}` {str(path)!r} {relation} {what}: choose a directory outside it"


def is_dcp_dir(path: PathLike | None) -> bool:
    """``path`` is a distributed (DCP) checkpoint directory (its ``.metadata`` or shards are there)."""
    if path is None or is_url(path) or not Path(path).is_dir():
        return False
    return (Path(path) / ".metadata").is_file() or any(Path(path).glob("*.distcp"))


def _resolved(path: PathLike | None) -> Path | None:
    return None if path is None or is_url(path) else Path(path).expanduser().resolve()


def remove_path(path: PathLike) -> None:
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX: the directory entry lives in the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def disk_full(err: BaseException) -> OSError | None:
    """The "no space left on device" OSError behind ``err``: itself, its cause or context, or one
    of the ranks' failures a distributed checkpoint save gathered (``CheckpointException``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        todo += [e.__cause__, None if e.__suppress_context__ else e.__context__]
        if isinstance(e, CheckpointException):  # (exception, traceback summary) per failed rank
            todo += [exc for exc, _ in e.failures.values()]
    return None


def disk_full_error(err: BaseException, what: str) -> DiskFullError | None:
    """The one-line error for ``err`` if a full disk is behind it (:func:`disk_full`), else None;
    ``what`` says what was being written (e.g. "checkpoint 'runs/last.ckpt'")."""
    full = disk_full(err)
    if full is None:
        return None
    file = f" ({full.filename})" if full.filename and str(full.filename) not in what else ""
    return DiskFullError(
        f"no space left on device while writing {what}{file}; free some space or point "
        "--trainer.default_root_dir at another disk"
    )


def check_before_load(
    path: Path, *, one_process: bool, expected: Mapping[str, tuple[int, ...]], strict: bool
) -> None:
    """Before anything is loaded: the checkpoint at ``path`` is readable, of the right kind for the
    number of processes, and its parameters fit the model (``expected`` shapes)."""
    if path.is_dir() and one_process:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a distributed (DCP) checkpoint directory, saved by "
            f"{dcp_writers(path)} processes; one process reads single-file checkpoints only: "
            "load it with --trainer.devices 2 or more and --trainer.strategy earl"
        )
    found = read_dcp_shapes(path) if path.is_dir() else read_checkpoint_shapes(path)
    check_checkpoint_matches(path, found, expected, strict)

"""A checkpoint given as a URL (``--ckpt_path https://...``): downloaded into a temporary file, under
a size limit, and then read like any local file (checked, data only). It is never handed to
Lightning, whose load of an ``http(s)`` URL unpickles it with ``weights_only=False``.

``http(s)`` is fetched with the standard library; any other scheme (``s3://``, ``gs://``,
``file://``...) through fsspec, whose filesystem for it must be installed. A URL names one
checkpoint file: a distributed (DCP) directory is copied to a local directory first.

No Lightning here (tier 1).
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from earl_lightning.checkpoints.loaders import reason
from earl_lightning.core.errors import CheckpointError

DOWNLOAD_LIMIT_BYTES = 64 * 2**30  # a checkpoint bigger than this is downloaded by hand
FREE_SPACE_KEPT_BYTES = 2**30  # a download never leaves less free on the temporary directory's disk
CHUNK_BYTES = 2**20
TIMEOUT_S = 60.0  # without a byte for this long, the download fails


def is_url(path: Any) -> bool:
    return "://" in str(path)


def download_checkpoint(url: str, arg: str, limit: int = DOWNLOAD_LIMIT_BYTES) -> Path:
    """The checkpoint file at ``url`` (given as ``arg``) copied into a new temporary directory
    (removed when the process ends; the caller may remove it sooner), or one CheckpointError line:
    unreachable, a directory, larger than ``limit`` bytes, or more than the disk can take."""
    where = f"`{arg}` {url!r}"
    name = Path(urllib.parse.urlparse(url).path).name or "checkpoint.ckpt"
    folder = Path(tempfile.mkdtemp(prefix="earl-ckpt-"))
    atexit.register(shutil.rmtree, folder, True)
    try:
        with _opened(url, where) as (stream, size):
            _copy(stream, folder / name, size, limit, where)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder / name


@contextlib.contextmanager
def local_checkpoint(path: Any, arg: str = "--ckpt_path") -> Iterator[Path]:
    """``path`` as a local path for the block: a URL downloaded (:func:`download_checkpoint`),
    its temporary copy removed after; a local path as it is."""
    if not is_url(path):
        yield Path(path)
        return
    local = download_checkpoint(str(path), arg)
    try:
        yield local
    finally:
        shutil.rmtree(local.parent, ignore_errors=True)


@contextlib.contextmanager
def _opened(url: str, where: str) -> Iterator[tuple[IO[bytes], int | None]]:
    """(a stream of the file at ``url``, its size when the server says it)."""
    scheme = urllib.parse.urlparse(url).scheme.lower()
    try:
        if scheme in ("http", "https"):
            response = urllib.request.urlopen(url, timeout=TIMEOUT_S)  # noqa: S310 - the scheme is checked
            length = response.headers.get("Content-Length")
            opened: tuple[IO[bytes], int | None] = (
                response,
                int(length) if length and length.isdigit() else None,
            )
        else:
            opened = _fsspec_open(url, where)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to reach the file is the URL's
        raise CheckpointError(f"{where} cannot be downloaded ({reason(err)})") from None
    with opened[0]:
        yield opened


def _fsspec_open(url: str, where: str) -> tuple[IO[bytes], int | None]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        raise CheckpointError(
            f"{where} is a directory (a distributed checkpoint?); only a single checkpoint file is "
            "downloaded: copy the directory to a local disk and pass its path"
        )
    size = fs.size(path)
    return fs.open(path, "rb"), int(size) if size is not None else None


def _copy(stream: IO[bytes], dest: Path, size: int | None, limit: int, where: str) -> None:
    def too_big(at_least: int) -> CheckpointError:
        return CheckpointError(
            f"{where} is larger than the download limit ({at_least:,} bytes or more, the limit is "
            f"{limit:,}); download it yourself and pass the file"
        )

    if size is not None and size > limit:
        raise too_big(size)
    free = shutil.disk_usage(dest.parent).free - FREE_SPACE_KEPT_BYTES
    if size is not None and size > free:
        raise _no_room(where, dest, size)
    written = 0
    try:
        with open(dest, "wb") as out:
            while chunk := stream.read(CHUNK_BYTES):
                written += len(chunk)
                if written > limit:
                    raise too_big(written)
                if written > free:
                    raise _no_room(where, dest, written)
                out.write(chunk)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a connection cut mid-download is the URL's
        raise CheckpointError(f"{where} cannot be downloaded ({reason(err)})") from None
    if size is not None and written != size:
        raise CheckpointError(
            f"{where} cannot be downloaded: {written:,} bytes came of the {size:,} announced "
            "(the connection was cut?)"
        )


def _no_room(where: str, dest: Path, need: int) -> CheckpointError:
    return CheckpointError(
        f"{where} does not fit in the temporary directory {str(dest.parent.parent)!r} ({need:,} "
        f"bytes or more, keeping {FREE_SPACE_KEPT_BYTES:,} free); point TMPDIR at a bigger disk, "
        "or download it yourself"
    )

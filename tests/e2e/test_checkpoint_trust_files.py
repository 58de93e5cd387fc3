"""A checkpoint file runs no code and a bad one is one line, under the default strategy too (issue
52, items 2 and 11): a checkpoint URL is downloaded into a temporary file (size-capped) and checked
like any file (Lightning would load an http(s) URL with ``weights_only=False``); ``--ckpt_path
last`` onto a planted or truncated file, and another model's checkpoint under ``strategy: auto``,
end the run in one line.

One real 1-step fit under ``strategy: auto`` gives the checkpoint every test copies or serves."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from earl_lightning.cli import main
from tests.distributed.launch import subprocess_env
from tests.e2e.test_checkpoint_trust import _RunsACommand, starts  # noqa: F401 - starts: a fixture
from tests.e2e.test_file_errors import (
    RECIPE,
    copy_run,
    error_line,
    fit,
    last_ckpt,
    recipe_saving_last_every_step,
    run_earl,
)
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run root) of a 1-step fit under `strategy: auto`: `checkpoints/last.ckpt`."""
    tmp = tmp_path_factory.mktemp("trained")
    recipe = recipe_saving_last_every_step(tmp)
    with pytest.MonkeyPatch.context() as patch:  # (conftest's argv fixture is per test)
        patch.setattr(sys, "argv", ["earl"])
        main(fit(recipe, tmp / "run", 1, "--trainer.strategy", "auto"))
    return recipe, tmp / "run"


def planted(real: Path, dest: Path, marker: Path) -> Path:
    """The checkpoint file ``real`` with one more entry: a pickle that runs ``touch marker``."""
    state = torch.load(real, weights_only=True)
    state["planted"] = _RunsACommand(marker)
    dest.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, dest)
    return dest


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving ``folder``, in a thread: its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def earl(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    """``earl ARGV`` in a subprocess whose temporary directory is ``tmp`` (where a download goes)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return run_earl_process(
        [str(Path(sys.executable).with_name("earl")), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT), TMPDIR=str(tmp)),
        timeout=300,
    )


# ---- a URL ---------------------------------------------------------------------------------------


def test_a_planted_checkpoint_url_is_downloaded_and_refused(trained, tmp_path):
    marker = tmp_path / "ran"
    served = planted(last_ckpt(trained[1]), tmp_path / "served" / "last.ckpt", marker)
    with serving(served.parent) as base:
        url = f"{base}/last.ckpt"
        proc = earl(
            tmp_path / "tmp",
            *fit(recipe_saving_last_every_step(tmp_path), tmp_path / "run", 2, "--ckpt_path", url),
        )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    pattern = (
        rf"earl: error: `--ckpt_path` '{re.escape(url)}' \(downloaded\): checkpoint "
        rf"'{re.escape(str(tmp_path / 'tmp'))}/earl-ckpt-\w+/last\.ckpt' holds posix\.system, a "
        r"type a checkpoint does not \(the file was not written by a save\); refused without running it"
    )
    assert re.fullmatch(pattern, line), line
    assert not marker.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained
    assert list((tmp_path / "tmp").iterdir()) == []  # the download removed


def test_a_checkpoint_url_resumes_the_run(trained, tmp_path, capsys, starts, monkeypatch):  # noqa: F811
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with serving(last_ckpt(trained[1]).parent) as base:
        recipe = recipe_saving_last_every_step(tmp_path)
        main(fit(recipe, tmp_path / "run", 2, "--ckpt_path", f"{base}/last.ckpt"))
    assert starts == [1]  # resumed at step 1: the served checkpoint's
    assert torch.load(last_ckpt(tmp_path / "run"), weights_only=True)["global_step"] == 2


def test_a_checkpoint_url_that_cannot_be_downloaded(trained, tmp_path, capsys):
    with serving(tmp_path) as base:
        url = f"{base}/missing.ckpt"
        code, err = run_earl(capsys, fit(RECIPE, tmp_path / "run", 1, "--ckpt_path", url))
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--ckpt_path` '{url}' cannot be downloaded (HTTPError: HTTP Error 404: File "
        "not found)"
    )


def test_a_download_stops_at_its_limit(trained, tmp_path):
    from earl_lightning.checkpoints.urls import download_checkpoint
    from earl_lightning.core.errors import CheckpointError

    size = last_ckpt(trained[1]).stat().st_size
    with serving(last_ckpt(trained[1]).parent) as base:
        url = f"{base}/last.ckpt"
        with pytest.raises(CheckpointError) as err:
            download_checkpoint(url, "--ckpt_path", limit=100_000)
        copy = download_checkpoint(url, "--ckpt_path", limit=size)
    assert str(err.value) == (
        f"`--ckpt_path` '{url}' is larger than the download limit ({size:,} bytes or more, the "
        "limit is 100,000); download it yourself and pass the file"
    )
    assert copy.read_bytes() == last_ckpt(trained[1]).read_bytes()
    shutil.rmtree(copy.parent)


def test_other_schemes_are_downloaded_too(trained, tmp_path):
    from earl_lightning.checkpoints.urls import download_checkpoint
    from earl_lightning.core.errors import CheckpointError

    copy = download_checkpoint(f"file://{last_ckpt(trained[1])}", "--ckpt_path")
    assert copy.read_bytes() == last_ckpt(trained[1]).read_bytes()
    shutil.rmtree(copy.parent)
    folder = f"file://{last_ckpt(trained[1]).parent}"
    with pytest.raises(CheckpointError, match=r"is a directory \(a distributed checkpoint\?\)"):
        download_checkpoint(folder, "--ckpt_path")


class _CutShort(http.server.BaseHTTPRequestHandler):
    """Announces 1,000,000 bytes, sends 1,000, hangs up."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        self.wfile.write(b"\0" * 1000)

    def log_message(self, *args) -> None:
        pass


def test_a_download_cut_short_or_too_big_for_the_disk(trained, tmp_path, monkeypatch):
    from earl_lightning.checkpoints import urls as checkpoint_urls
    from earl_lightning.core.errors import CheckpointError

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/last.ckpt"
    try:
        with pytest.raises(CheckpointError) as err:
            checkpoint_urls.download_checkpoint(url, "--ckpt_path")
    finally:
        server.shutdown()
        server.server_close()
    assert str(err.value) == (
        f"`--ckpt_path` '{url}' cannot be downloaded: 1,000 bytes came of the 1,000,000 announced "
        "(the connection was cut?)"
    )
    monkeypatch.setattr(checkpoint_urls, "FREE_SPACE_KEPT_BYTES", 2**62)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    size = last_ckpt(trained[1]).stat().st_size
    with serving(last_ckpt(trained[1]).parent) as base:
        with pytest.raises(CheckpointError) as err:
            checkpoint_urls.download_checkpoint(f"{base}/last.ckpt", "--ckpt_path")
    assert str(err.value) == (
        f"`--ckpt_path` '{base}/last.ckpt' does not fit in the temporary directory '{tmp_path}' "
        f"({size:,} bytes or more, keeping {2**62:,} free); point TMPDIR at a bigger disk, or "
        "download it yourself"
    )
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_weights_only_false_is_refused(trained, tmp_path, capsys):
    argv = fit(RECIPE, tmp_path / "run", 1, "--ckpt_path", str(last_ckpt(trained[1])))
    code, err = run_earl(capsys, [*argv, "--weights_only", "false"])
    assert code == 2
    assert error_line(err) == (
        "earl: error: `--weights_only` false: earl reads a checkpoint as data and tensors only "
        "(weights_only), never unpickling code it holds; leave it unset"
    )


# ---- --ckpt_path last onto a planted or truncated file -------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "earl"])
def test_ckpt_path_last_onto_a_planted_file(trained, tmp_path, capsys, strategy):
    marker = tmp_path / "ran"
    recipe, root = copy_run(trained, tmp_path)
    last = last_ckpt(root)
    planted(last, last, marker)
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", strategy, "--ckpt_path", "last")
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{last}' holds posix.system, a type a checkpoint does not (the "
        "file was not written by a save); refused without running it"
    )
    assert not marker.exists()


def test_ckpt_path_last_onto_a_truncated_file_under_strategy_auto(trained, tmp_path, capsys):
    recipe, root = copy_run(trained, tmp_path)
    last = last_ckpt(root)
    os.truncate(last, 100_000)
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", "auto", "--ckpt_path", "last")
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{last}' is truncated or not a checkpoint file (100,000 "
        "bytes, no end-of-archive record): its save or copy was interrupted? Use an earlier "
        "checkpoint"
    )


# ---- another model's checkpoint ----------------------------------------------------------------------


def test_another_models_checkpoint_under_strategy_auto(trained, tmp_path, capsys):
    """The GRPO recipe (no value head) resumed from the actor-critic recipe's checkpoint."""
    _, root = copy_run(trained, tmp_path)
    recipe = recipe_saving_last_every_step(tmp_path, RECIPE.with_name("connect4_grpo.yaml"))
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", "auto", "--ckpt_path", "last")
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{last_ckpt(root)}' is from another model: 2 unexpected key(s), e.g. "
        "['value_head.bias', 'value_head.weight'] (the model and the recipe must be those of the run that saved it)"
    )

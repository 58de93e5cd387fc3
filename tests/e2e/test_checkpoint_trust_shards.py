"""A distributed (DCP) checkpoint's shards run no code (issue 52, item 1): their non-tensor entries
(an optimizer's `lr`, `betas`, `params`...), which torch's default load planner unpickles with
``weights_only=False``, are read as data only under every strategy (`auto`: loaded whole;
EarlStrategy on 2 processes) and by `earl export`; what a real save writes still loads.

One real 2-process fit under EarlStrategy gives the checkpoint; a planted copy has its optimizer's
`lr` entry replaced by a pickle that runs `touch marker` when unpickled."""

from __future__ import annotations

import io
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from earl_lightning.checkpoints.export import POLICY_PREFIX, _load_dcp_policy
from earl_lightning.checkpoints.io import load_dcp_whole
from earl_lightning.core.errors import CheckpointError
from earl_lightning.models import load_model
from tests.distributed.launch import subprocess_env
from tests.e2e.test_checkpoint_trust import _RunsACommand
from tests.e2e.test_file_errors import error_line, fit, recipe_saving_last_every_step, run_earl
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
LR = "optimizer_0.param_groups.0.lr"


def earl(*argv: str) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(Path(sys.executable).with_name("earl")), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        timeout=600,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The DCP `last.ckpt` directory of a 1-step fit on 2 processes under EarlStrategy."""
    tmp = tmp_path_factory.mktemp("dcp")
    recipe = recipe_saving_last_every_step(tmp)
    proc = earl(
        *fit(recipe, tmp / "run", 1, "--trainer.devices", "2", "--trainer.strategy", "earl")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = tmp / "run" / "checkpoints" / "last.ckpt"
    assert (last / ".metadata").is_file()
    return last


def plant(real: Path, dest: Path, marker: Path, key: str = LR) -> Path:
    """A copy of the DCP directory ``real`` whose entry ``key`` is a non-tensor entry holding a
    pickle that runs ``touch marker``: appended to a shard, its .metadata (torch's own types)
    pointing at it."""
    shutil.copytree(real, dest)
    metadata = FileSystemReader(dest).read_metadata()
    payload = io.BytesIO()
    torch.save(_RunsACommand(marker), payload)
    chunks = [i for i in metadata.storage_data if i.fqn == key]
    shard = dest / metadata.storage_data[chunks[0]].relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    for index in chunks:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(
        shard.name, offset, len(payload.getvalue())
    )
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    (dest / ".metadata").write_bytes(pickle.dumps(metadata))
    return dest


def refused(ckpt: Path, key: str = LR) -> str:
    return (
        f"checkpoint '{ckpt}': its entry {key} holds posix.system, which a checkpoint's non-tensor "
        "entries do not (the shard was not written by a save); refused without running it"
    )


def test_what_a_real_save_writes_loads_whole_as_torch_reads_it(saved, tmp_path):
    """Every entry of a real 2-process save (13 non-tensor ones: the optimizer's param groups) reads
    through the restricted loader as torch's own DCP-to-file conversion reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(saved, tmp_path / "reference.pt")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    loaded = load_dcp_whole(saved)
    assert loaded["optimizer_states"][0]["param_groups"][0]["lr"] == 1e-3
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    groups = reference["optimizer_0"]["param_groups"]
    assert len(groups[0]) == 13 and groups[0]["params"][0] == "policy.model.embed_tokens.weight"
    for key, value in reference["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value), key
    assert loaded["global_step"] == 1


def test_a_planted_shard_entry_under_strategy_auto(saved, tmp_path, capsys):
    """`--ckpt_path` a planted DCP directory, resumed on one process (loaded whole): one line."""
    marker = tmp_path / "ran"
    ckpt = plant(saved, tmp_path / "planted.ckpt", marker)
    code, err = run_earl(
        capsys,
        fit(
            recipe_saving_last_every_step(tmp_path),
            tmp_path / "run",
            2,
            "--trainer.strategy",
            "auto",
            "--ckpt_path",
            str(ckpt),
        ),
    )
    assert code == 1
    assert error_line(err) == f"earl: error: {refused(ckpt)}"
    assert not marker.exists()


def test_a_planted_shard_entry_under_earl_strategy_on_two_processes(saved, tmp_path):
    """EarlStrategy's own DCP load (model, then optimizer): refused on every rank, nothing run."""
    marker = tmp_path / "ran"
    ckpt = plant(saved, tmp_path / "planted.ckpt", marker)
    proc = earl(
        *fit(
            recipe_saving_last_every_step(tmp_path),
            tmp_path / "run",
            2,
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "earl",
            "--ckpt_path",
            str(ckpt),
        )
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"earl: error: {refused(ckpt)}" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_export_reads_a_planted_policy_entry_as_data(saved, tmp_path):
    """`earl export`'s DCP read itself (below its shape check, which refuses a policy weight stored
    as anything but a tensor): a planted entry among the policy's is refused, not run."""
    marker = tmp_path / "ran"
    key = "state_dict." + POLICY_PREFIX + "model.norm.weight"
    ckpt = plant(saved, tmp_path / "planted.ckpt", marker, key)
    with pytest.raises(CheckpointError) as err:
        _load_dcp_policy(ckpt, load_model("earl-tiny"))
    assert str(err.value) == f"`--ckpt_path`: {refused(ckpt, key)}"
    assert not marker.exists()


def test_every_reader_refuses_a_planted_entry(saved, tmp_path):
    from earl_lightning.checkpoints.loaders import load_dcp, load_entry

    marker = tmp_path / "ran"
    ckpt = plant(saved, tmp_path / "planted.ckpt", marker)
    with pytest.raises(CheckpointError) as err:
        load_dcp_whole(ckpt)
    assert str(err.value) == refused(ckpt)
    with pytest.raises(CheckpointError) as err:
        load_dcp({}, ckpt, whole=True)
    assert str(err.value) == refused(ckpt)
    entry = io.BytesIO()
    torch.save({"lr": 0.1, "f": print}, entry)
    entry.seek(0)
    with pytest.raises(CheckpointError, match=r"its entry k holds builtins\.print, which"):
        load_entry(entry, "checkpoint 'x'", "k")
    assert not marker.exists()

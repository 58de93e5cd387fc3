"""The export's pieces on one process: the atomic directory write (an error or a SIGKILL mid-write
never leaves half a directory under the final name), the gathered state dict, ExportModel's
directory and switch. Sharded models: tests/distributed/test_export_gather.py; whole runs:
tests/e2e/test_export.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from earl_lightning.callbacks import ExportModel
from earl_lightning.checkpoints.export import gather_state_dict
from earl_lightning.checkpoints.files import write_dir_atomically
from earl_lightning.core.errors import EarlError
from earl_lightning.models import load_model


def test_a_failed_write_leaves_the_previous_directory_and_no_temporary(tmp_path):
    out = tmp_path / "model"

    def partial(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        write_dir_atomically(out, partial)
    assert list(tmp_path.iterdir()) == []
    write_dir_atomically(out, lambda tmp: (tmp / "weights").write_text("v1"))
    with pytest.raises(OSError, match="disk went away"):
        write_dir_atomically(out, partial)
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (
        out / "weights"
    ).read_text() == "v1"
    assert [p.name for p in out.iterdir()] == ["weights"]


KILLED_WHILE_EXPORTING = """
import sys, torch
from earl_lightning.checkpoints.export import write_pretrained
from earl_lightning.models import load_model, load_tokenizer
model, tok = load_model("earl-tiny"), load_tokenizer("earl-tiny")
step = 0
while True:
    step += 1
    with torch.no_grad():
        model.model.norm.weight.fill_(float(step))
    write_pretrained(model, tok, sys.argv[1])
    print(step, flush=True)
"""


def test_a_process_killed_while_exporting_leaves_a_whole_directory(tmp_path):
    """SIGKILL at an arbitrary point of a loop of exports: the directory under the final name is
    always a whole one (a kill between the two renames of the replacement leaves it as .<name>.old)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf_model"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_EXPORTING, str(out)], stdout=subprocess.PIPE, text=True
    )
    for _ in range(3):
        proc.stdout.readline()
    proc.kill()
    proc.wait()
    whole = out if out.exists() else tmp_path / ".hf_model.old"
    model = AutoModelForCausalLM.from_pretrained(whole)
    norm = model.model.norm.weight.detach()
    assert norm[0].item() >= 2 and bool((norm == norm[0]).all())


def test_gathered_state_dict_of_a_plain_model():
    model = load_model("earl-tiny")
    state = gather_state_dict(model, keep=True)
    assert list(state) == list(model.state_dict())
    # tied: one tensor, saved once
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert gather_state_dict(model, keep=False) is None


def test_export_directory_and_switch(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "run" / "checkpoints"))
    trainer = SimpleNamespace(
        checkpoint_callback=checkpoints,
        log_dir=str(tmp_path / "logs"),
        default_root_dir=str(tmp_path),
    )
    assert ExportModel().resolve_dirpath(trainer) == Path(checkpoints.dirpath).parent / "hf_model"
    assert ExportModel(dirpath="elsewhere").resolve_dirpath(trainer) == Path("elsewhere")
    trainer.checkpoint_callback = None
    assert ExportModel().resolve_dirpath(trainer) == tmp_path / "logs" / "hf_model"
    # writes nothing, asks nothing of the module
    ExportModel(enabled=False).on_fit_end(trainer, object())
    assert not (tmp_path / "logs").exists()
    with pytest.raises(
        TypeError,
        match=r"ExportModel needs a module with `policy` and `tokenizer` .*; object has not",
    ):
        ExportModel().on_fit_end(trainer, object())


def test_export_dirpath_is_checked_when_the_fit_starts(tmp_path):
    """Outside `earl fit` too (a Trainer built by hand): the callback's own check at setup."""
    root, logs = tmp_path / "run", tmp_path / "logs"
    checkpoints = ModelCheckpoint(dirpath=str(root / "checkpoints"))
    trainer = SimpleNamespace(
        default_root_dir=str(root),
        loggers=[SimpleNamespace(save_dir=str(logs))],
        checkpoint_callbacks=[checkpoints],
        ckpt_path=str(tmp_path / "old" / "last.ckpt"),
    )
    for dirpath in (root / "hf_model", logs / "version_0" / "hf_model", tmp_path / "new"):
        ExportModel(dirpath=str(dirpath)).setup(trainer, object(), "fit")
    cases = {
        logs: f"is the run's logs ('{logs}')",
        tmp_path
        / "old": f"contains the checkpoint the run reads ('{tmp_path / 'old' / 'last.ckpt'}')",
        root: f"is the run's root (`--trainer.default_root_dir` '{root}')",
    }
    for dirpath, what in cases.items():
        with pytest.raises(EarlError) as err:
            ExportModel(dirpath=str(dirpath), overwrite=True).setup(trainer, object(), "fit")
        assert str(err.value) == (
            f"`--export.dirpath` '{dirpath}' {what}; writing it replaces the whole directory: "
            "choose another"
        )
    link = tmp_path / "link"
    link.symlink_to(root / "checkpoints", target_is_directory=True)
    with pytest.raises(EarlError, match=r"'.*link' is the run's checkpoints \("):
        ExportModel(dirpath=str(link), overwrite=True).setup(trainer, object(), "fit")
    ExportModel(dirpath=str(root)).setup(trainer, object(), "validate")  # a fit's only
    ExportModel(dirpath=str(root), enabled=False).setup(trainer, object(), "fit")

"""Bad files end a run with one line naming the path and what is wrong (issue 15, item 5): a
truncated or corrupt checkpoint, a checkpoint of another model, an empty or partial model directory,
a full disk while saving; and a save cut short leaves the previous checkpoint loadable.

The `earl` command exits 2 for what it finds while reading its arguments and building its classes,
1 for what it finds during the run.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.distributed.checkpoint import FileSystemReader

from earl_lightning.checkpoints.files import read_dcp_shapes, save_file_atomically
from earl_lightning.cli import main
from earl_lightning.core.errors import EarlError, ModelFilesError
from earl_lightning.models import load_model, load_tokenizer, make_tiny_model
from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "connect4_ppo.yaml"
QUIET = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.limit_val_batches",
    "0",
    "--data.batch_size",
    "8",
    "--data.group_size",
    "4",
    "--data.eval_episodes",
    "0",
]


def recipe_saving_last_every_step(tmp: Path, base: Path = RECIPE) -> Path:
    """The default recipe with one ModelCheckpoint: `last.ckpt` in ``tmp/run/checkpoints`` after every
    step, nothing else. (A fixed directory: by default checkpoints go under the logger's next
    `version_N`, where a later `--ckpt_path last` does not look.)"""
    cfg = yaml.safe_load(base.read_text())
    cfg["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "save_last": True,
                "save_top_k": 0,
                "every_n_train_steps": 1,
                "dirpath": str(tmp / "run" / "checkpoints"),
            },
        }
    ]
    out = tmp / base.name
    out.write_text(yaml.safe_dump(cfg))
    return out


def fit(recipe: Path, root: Path, steps: int, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(recipe),
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        *QUIET,
        *extra,
    ]


def run_earl(capsys, argv: list[str]) -> tuple[int, str]:
    """``earl ARGV`` in-process: (exit code, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("earl: error: ")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def last_ckpt(root: Path) -> Path:
    return max(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run root) of a 1-step fit under EarlStrategy on one process: a plain `last.ckpt`."""
    tmp = tmp_path_factory.mktemp("trained")
    recipe = recipe_saving_last_every_step(tmp)
    main(fit(recipe, tmp / "run", 1, "--trainer.strategy", "earl"))
    return recipe, tmp / "run"


def copy_run(trained, tmp_path: Path) -> tuple[Path, Path]:
    """(recipe, root) of a copy of the trained run in ``tmp_path``, its checkpoints found by `last`."""
    shutil.copytree(trained[1], tmp_path / "run")
    return recipe_saving_last_every_step(tmp_path), tmp_path / "run"


# ---- a truncated or corrupt checkpoint ---------------------------------------------------------------


def corrupt_pickle(src: Path, dst: Path) -> None:
    """``src`` with an invalid opcode in its pickle: the zip archive is whole, its content is not."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            data = zin.read(name)
            zout.writestr(
                name, data[:2] + bytes([154]) + data[3:] if name.endswith("data.pkl") else data
            )


def test_truncated_checkpoint_named_on_the_command_line(trained, tmp_path, capsys):
    bad = tmp_path / "cut.ckpt"
    bad.write_bytes(last_ckpt(trained[1]).read_bytes()[:100_000])
    code, err = run_earl(
        capsys,
        [
            "validate",
            "--config",
            str(trained[0]),
            "--ckpt_path",
            str(bad),
            "--trainer.default_root_dir",
            str(tmp_path / "val"),
            *QUIET,
        ],
    )
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--ckpt_path`: checkpoint '{bad}' is truncated or not a checkpoint file (100,000 bytes, no "
        "end-of-archive record): its save or copy was interrupted? Use an earlier checkpoint"
    )


def test_corrupt_checkpoint_named_on_the_command_line(trained, tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    corrupt_pickle(last_ckpt(trained[1]), bad)
    code, err = run_earl(
        capsys,
        [
            "validate",
            "--config",
            str(trained[0]),
            "--ckpt_path",
            str(bad),
            "--trainer.default_root_dir",
            str(tmp_path / "val"),
            *QUIET,
        ],
    )
    assert code == 2
    assert error_line(err) == (
        f"earl: error: `--ckpt_path`: checkpoint '{bad}' is corrupt or not a checkpoint: torch.load failed with "
        "UnpicklingError: Unsupported operand 154. Use an earlier checkpoint"
    )


def test_missing_checkpoint_named_on_the_command_line(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "last.ckpt"
    code, err = run_earl(capsys, fit(RECIPE, tmp_path / "run", 1, "--ckpt_path", str(missing)))
    assert code == 2
    assert error_line(err) == f"earl: error: `--ckpt_path`: checkpoint '{missing}' does not exist"


def test_an_error_line_reaches_stderr_in_one_write(tmp_path, monkeypatch):
    # Every rank of a multi-process run reports its error at the same moment; `print` writes the
    # text and the newline in two writes to the write-through stderr, and two ranks' lines then ran
    # into one ("...another diskearl: error: ..."). One write per line cannot interleave.
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    missing = tmp_path / "nowhere" / "last.ckpt"
    with pytest.raises(SystemExit):
        main(fit(RECIPE, tmp_path / "run", 1, "--ckpt_path", str(missing)))
    assert f"earl: error: `--ckpt_path`: checkpoint '{missing}' does not exist\n" in writes, writes


def test_truncated_last_checkpoint_on_resume(trained, tmp_path, capsys):
    recipe, root = copy_run(trained, tmp_path)
    last = last_ckpt(root)
    os.truncate(last, 100_000)
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", "earl", "--ckpt_path", "last")
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{last}' is truncated or not a checkpoint file (100,000 "
        "bytes, no end-of-archive record): its save or copy was interrupted? Use an earlier "
        "checkpoint"
    )


# ---- a checkpoint of another model ---------------------------------------------------------------------


def test_checkpoint_of_a_model_with_another_hidden_size(trained, tmp_path, capsys):
    """`--ckpt_path last` into a run directory whose checkpoint another model wrote."""
    narrow = make_tiny_model(
        "earl-tiny",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    recipe, root = recipe_saving_last_every_step(tmp_path), tmp_path / "run"
    main(fit(recipe, root, 1, "--trainer.strategy", "earl", "--model.model", str(narrow)))
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", "earl", "--ckpt_path", "last")
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{last_ckpt(root)}' is from another model: policy.model.embed_tokens.weight has "
        "shape [104, 64] there and [104, 128] in this model (the model and the recipe must be those of the run that "
        "saved it)"
    )


def test_checkpoint_of_a_module_with_other_parts(trained, tmp_path, capsys):
    """The GRPO recipe (no value head) resumed from the actor-critic recipe's checkpoint."""
    _, root = copy_run(trained, tmp_path)
    recipe = recipe_saving_last_every_step(tmp_path, RECIPE.with_name("connect4_grpo.yaml"))
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", "earl", "--ckpt_path", "last")
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{last_ckpt(root)}' is from another model: 2 unexpected key(s), e.g. "
        "['value_head.bias', 'value_head.weight'] (the model and the recipe must be those of the run that saved it)"
    )


# ---- an empty or partial model directory -----------------------------------------------------------------

NEEDS = {
    "config": "config.json",
    "weights": r"model weights \(\*.safetensors or pytorch_model\*.bin\)",
    "tokenizer": r"tokenizer files \(tokenizer.json, or a vocabulary such as tokenizer.model, vocab.json or "
    r"vocab.txt\)",
}


def partial_model_dir(tmp_path: Path, keep: tuple[str, ...]) -> Path:
    src, out = Path(make_tiny_model("earl-tiny")), tmp_path / "model"
    out.mkdir()
    kinds = {
        "config": ["config.json", "generation_config.json"],
        "weights": ["model.safetensors"],
        "tokenizer": ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"],
    }
    for kind in keep:
        for name in kinds[kind]:
            if (src / name).exists():
                shutil.copy(src / name, out / name)
    return out


@pytest.mark.parametrize("keep", [(), ("config",), ("weights", "tokenizer"), ("config", "weights")])
def test_empty_or_partial_model_directory(tmp_path, capsys, keep):
    model = partial_model_dir(tmp_path, keep)
    missing = ", ".join(NEEDS[k] for k in NEEDS if k not in keep)
    what = "an empty directory" if not keep else "not a complete model directory"
    code, err = run_earl(capsys, fit(RECIPE, tmp_path / "run", 1, "--model.model", str(model)))
    assert code == 2
    pattern = (
        rf"earl: error: `--model.model`: '{model}' is {what}: missing {missing}. A model directory is what "
        r"save_pretrained writes for a model and its tokenizer"
    )
    assert re.fullmatch(pattern, error_line(err)), error_line(err)
    with pytest.raises(
        ModelFilesError, match=rf"`--model.model`: '{model}' is {what}: missing {missing}\."
    ):
        load_tokenizer(str(model), "--model.model")


def test_model_path_that_is_a_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(
        FileNotFoundError,
        match=r"`--model.model`: '.*weights.bin' is a file, not a model directory",
    ):
        load_model(str(tmp_path / "weights.bin"), arg="--model.model")


def test_truncated_weights(tmp_path):
    model = partial_model_dir(tmp_path, ("config", "weights", "tokenizer"))
    os.truncate(model / "model.safetensors", 10_000)
    with pytest.raises(
        ModelFilesError,
        match=rf"`--model.model`: the weights in '{model}' cannot be read \(Error "
        r"while deserializing header: .*\); the file is truncated or corrupt",
    ):
        load_model(str(model), arg="--model.model")


def test_sharded_weights_with_a_shard_missing(tmp_path):
    model = partial_model_dir(tmp_path, ("config", "weights", "tokenizer"))
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )
    with pytest.raises(
        ModelFilesError,
        match=r"model.safetensors.index.json names 2 weight file\(s\) that are "
        r"missing: \['model-00001-of-00002.safetensors'",
    ):
        load_tokenizer(str(model), "--model.model")


# ---- a full disk, and saves cut short ----------------------------------------------------------------------


def torch_save_filling_the_disk(real_save):
    """``torch.save`` that writes part of the checkpoint, then finds the disk full."""

    def save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()[:4096]
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(data)
        else:
            f.write(data)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return save


def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    """A resumed run whose save of `last.ckpt` at step 2 finds the disk full (after writing part of it)."""
    recipe, root = recipe_saving_last_every_step(tmp_path), tmp_path / "run"
    main(fit(recipe, root, 1, "--trainer.strategy", "earl"))
    last = last_ckpt(root)
    monkeypatch.setattr(torch, "save", torch_save_filling_the_disk(torch.save))
    code, err = run_earl(
        capsys, fit(recipe, root, 2, "--trainer.strategy", "earl", "--ckpt_path", "last")
    )
    monkeypatch.undo()
    assert code == 1
    assert error_line(err) == (
        f"earl: error: no space left on device while writing checkpoint '{last}'; free some "
        "space or point --trainer.default_root_dir at another disk"
    )
    assert torch.load(last, weights_only=True)["global_step"] == 1  # the step-1 checkpoint, whole
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no partial file left


def test_full_disk_under_lightnings_own_strategy(trained, tmp_path, capsys, monkeypatch):
    """The default strategy saves through the CheckpointIO `earl fit` gives every strategy
    (AtomicCheckpointIO): still one line, naming the run's directory."""
    monkeypatch.setattr(torch, "save", torch_save_filling_the_disk(torch.save))
    code, err = run_earl(capsys, fit(recipe_saving_last_every_step(tmp_path), tmp_path / "run", 1))
    monkeypatch.undo()
    assert code == 1
    assert error_line(err) == (
        f"earl: error: no space left on device while writing the run's outputs under "
        f"'{tmp_path / 'run'}'; free some space or point "
        "--trainer.default_root_dir at another disk"
    )


def test_full_disk_while_logging(tmp_path, capsys, monkeypatch):
    events = str(tmp_path / "run" / "events.out.tfevents")

    def log_metrics(self, metrics, step=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), events)

    monkeypatch.setattr(L.pytorch.loggers.TensorBoardLogger, "log_metrics", log_metrics)
    code, err = run_earl(capsys, fit(RECIPE, tmp_path / "run", 1))
    assert code == 1
    assert error_line(err) == (
        f"earl: error: no space left on device while writing the run's outputs under "
        f"'{tmp_path / 'run'}' ({events}); free some space or "
        "point --trainer.default_root_dir at another disk"
    )


def test_a_save_interrupted_by_an_exception_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_file_atomically({"step": 1, "w": torch.ones(1000)}, path)
    monkeypatch.setattr(torch, "save", torch_save_filling_the_disk(torch.save))
    with pytest.raises(OSError, match="No space left on device"):
        save_file_atomically({"step": 2, "w": torch.zeros(1000)}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


KILLED_WHILE_SAVING = """
import sys, torch
from earl_lightning.checkpoints.files import save_file_atomically
step = 0
while True:
    step += 1
    save_file_atomically({"step": step, "w": torch.full((4_000_000,), float(step))}, sys.argv[1])
    print(step, flush=True)
"""


def test_a_process_killed_while_saving_leaves_a_whole_checkpoint(tmp_path):
    """SIGKILL at an arbitrary point of a loop of saves: the file is always the last complete one."""
    path = tmp_path / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_SAVING, str(path)], stdout=subprocess.PIPE, text=True
    )
    for _ in range(3):  # three complete saves, then the kill lands inside one of the next
        proc.stdout.readline()
    proc.kill()
    proc.wait()
    state = torch.load(path, weights_only=True)
    assert state["step"] >= 3 and bool((state["w"] == float(state["step"])).all())


# ---- distributed (DCP) checkpoints on 2 processes -----------------------------------------------------------


class FullDiskAtSecondSave(L.Callback):
    """On rank 1, the DCP writer of the step-2 checkpoint finds the disk full after its first item."""

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != 2 or trainer.global_rank != 1:
            return
        from torch.distributed.checkpoint import filesystem

        real, calls = filesystem._write_item, []

        def write_item(*a, **kw):
            calls.append(1)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*a, **kw)

        filesystem._write_item = write_item


def earl_subprocess(*argv: str) -> subprocess.CompletedProcess:
    earl = Path(sys.executable).with_name("earl")
    return run_earl_process(
        [str(earl), *argv],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dcp_checkpoints_full_disk_then_truncated_shard(tmp_path):
    """2 processes under EarlStrategy: a full disk on one rank while saving step 2 ends the run in one
    line and keeps step 1's DCP directory whole; a truncated shard of it is named when loaded."""
    recipe = recipe_saving_last_every_step(tmp_path)
    proc = earl_subprocess(
        *fit(
            recipe,
            tmp_path / "run",
            2,
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "earl",
            "--trainer.callbacks+=tests.e2e.test_file_errors.FullDiskAtSecondSave",
        )
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    last = last_ckpt(tmp_path / "run")
    assert (
        f"earl: error: no space left on device while writing checkpoint '{last}'; free some space or point "
        "--trainer.default_root_dir at another disk"
    ) in proc.stderr.splitlines(), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 1
    assert "value_head.weight" in read_dcp_shapes(last)  # every shard whole
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]

    bad = last.with_name("cut.ckpt")
    shutil.copytree(last, bad)
    os.truncate(bad / "__1_0.distcp", 100_000)
    storage = FileSystemReader(bad).read_metadata().storage_data.values()
    need = max(
        info.offset + info.length for info in storage if info.relative_path == "__1_0.distcp"
    )
    proc = earl_subprocess(
        "validate",
        "--config",
        str(recipe),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "earl",
        "--ckpt_path",
        str(bad),
        "--trainer.default_root_dir",
        str(tmp_path / "val"),
        *QUIET,
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert (
        f"earl: error: checkpoint '{bad}' is truncated: shard __1_0.distcp has 100,000 bytes, its .metadata needs "
        f"{need:,} bytes (an interrupted save or copy?). Use an earlier checkpoint"
    ) in proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def test_dcp_directory_on_one_process(tmp_path, capsys):
    """A DCP directory given to a one-process run (which reads single files): one line saying so."""
    ckpt = tmp_path / "last.ckpt"
    ckpt.mkdir()
    for rank in range(2):
        (ckpt / f"__{rank}_0.distcp").write_bytes(b"")
    code, err = run_earl(
        capsys,
        fit(RECIPE, tmp_path / "run", 1, "--trainer.strategy", "earl", "--ckpt_path", str(ckpt)),
    )
    assert code == 1
    assert error_line(err) == (
        f"earl: error: checkpoint '{ckpt}' is a distributed (DCP) checkpoint directory, saved by 2 processes; one "
        "process reads single-file checkpoints only: load it with --trainer.devices 2 or more and --trainer.strategy "
        "earl"
    )


def test_model_files_error_is_a_configuration_error_and_a_run_error():
    """Found while the command builds its classes: a FileNotFoundError (exit 2); later: an EarlError (exit 1)."""
    assert issubclass(ModelFilesError, FileNotFoundError) and issubclass(ModelFilesError, EarlError)

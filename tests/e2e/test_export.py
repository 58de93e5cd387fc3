"""The trained model to take away (issue 44, item 2): `earl fit` ends by writing a save_pretrained
directory beside its checkpoints, and `earl export` writes the same directory from any checkpoint,
a `strategy: auto` .ckpt file or a DCP directory that 2 processes wrote under EarlStrategy.

Transformers loads it and gives the log-probs of the policy in the checkpoint; the tokenizer keeps
its chat template; every bad argument is one line naming it. (vLLM: tests/vllm/test_export_vllm.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from earl_lightning.checkpoints.export import EXPORT_DIRNAME
from earl_lightning.cli import main
from earl_lightning.models import load_model, load_tokenizer
from tests.distributed.launch import subprocess_env
from tests.e2e.test_file_errors import error_line, fit, recipe_saving_last_every_step, run_earl
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """A 2-step `earl fit` of the default recipe (PPO) under `strategy: auto`; checkpoints in
    ``run/checkpoints``, so the trained model is written to ``run/hf_model``."""
    tmp = tmp_path_factory.mktemp("auto")
    with pytest.MonkeyPatch.context() as patch:  # (conftest's argv fixture is per test)
        patch.setattr(sys, "argv", ["earl"])
        main(fit(recipe_saving_last_every_step(tmp), tmp / "run", 2))
    return tmp / "run"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """The same fit on 2 processes under EarlStrategy (dp=2: FSDP2-sharded weights, DCP
    checkpoints), the trained model written where ``--export.dirpath`` says."""
    tmp = tmp_path_factory.mktemp("earl")
    recipe = recipe_saving_last_every_step(tmp)
    earl = Path(sys.executable).with_name("earl")
    proc = run_earl_process(
        [
            str(earl),
            *fit(
                recipe,
                tmp / "run",
                2,
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                "earl",
                "--export.dirpath",
                str(tmp / "run" / "exported"),
            ),
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp / "run" / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    return tmp / "run"


def policy_of(ckpt: Path) -> torch.nn.Module:
    """The trained policy as the checkpoint holds it (the reference)."""
    model = load_model("earl-tiny")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict(
        {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
    )
    return model.eval()


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()  # [T-1, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [T-1]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def assert_trained(directory: Path) -> None:
    """The directory holds trained weights, not the starting ones (else equality proves nothing)."""
    start = load_model("earl-tiny").state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in weights(directory).items())


def test_fit_ends_with_a_model_transformers_loads_with_the_policys_logprobs(one_process):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = one_process / EXPORT_DIRNAME
    # no temporary left
    assert sorted(p.name for p in one_process.iterdir() if p.name.startswith(".")) == []
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.use_cache  # served with the KV cache, although training turns it off
    assert model.generation_config.eos_token_id == tok.eos_token_id
    original = load_tokenizer("earl-tiny")
    assert tok.chat_template == original.chat_template and tok.chat_template
    chat = [{"role": "user", "content": "Your move."}, {"role": "assistant", "content": "3"}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ids == original.apply_chat_template(chat, tokenize=True, return_dict=False)
    reference = policy_of(one_process / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(
        token_logprobs(model, ids), token_logprobs(reference, ids), rtol=0, atol=1e-6
    )
    assert_trained(out)


def test_export_of_a_ckpt_file_is_the_fits_own_export(one_process, tmp_path, capsys):
    out = tmp_path / "exported"
    main(
        ["export", "--ckpt_path", str(one_process / "checkpoints" / "last.ckpt"), "--out", str(out)]
    )
    assert f"to {str(out)!r}" in capsys.readouterr().out
    assert_same_weights(weights(out), weights(one_process / EXPORT_DIRNAME))
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert json.loads((out / name).read_text()) == json.loads(
            (one_process / EXPORT_DIRNAME / name).read_text()
        )


def test_export_of_a_two_process_dcp_checkpoint_is_the_gathered_model(two_processes, tmp_path):
    """Read in one process, the DCP shards of 2 processes give the weights rank 0 gathered from
    FSDP at the end of the fit, bit for bit."""
    out = tmp_path / "exported"
    main(
        [
            "export",
            "--ckpt_path",
            str(two_processes / "checkpoints" / "last.ckpt"),
            "--out",
            str(out),
        ]
    )
    gathered = two_processes / "exported"
    assert not (two_processes / EXPORT_DIRNAME).exists()  # --export.dirpath was obeyed
    assert_same_weights(weights(out), weights(gathered))
    assert_trained(out)
    config = json.loads((gathered / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # not the FSDP wrapper's class


def test_export_can_be_switched_off_and_moved_from_the_command_line(capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                str(ROOT / "recipes" / "connect4_ppo.yaml"),
                "--export.enabled",
                "false",
                "--export.dirpath",
                "elsewhere",
                "--print_config",
            ]
        )
    printed = capsys.readouterr().out
    assert "export:\n  dirpath: elsewhere\n  enabled: false" in printed, printed[-2000:]


# ---- errors: one line naming the argument ------------------------------------------------------------


def fake_checkpoint(path: Path, model: str = "earl-tiny") -> Path:
    """A Lightning-shaped checkpoint of ``model``'s untrained weights."""
    state = {f"policy.{k}": v for k, v in load_model("earl-tiny").state_dict().items()}
    torch.save(
        {"hyper_parameters": {"model": model, "dtype": "float32"}, "state_dict": state}, path
    )
    return path


def export_error(capsys, *argv: str) -> str:
    code, err = run_earl(capsys, ["export", *argv])
    assert code == 2
    return error_line(err)


def test_missing_and_non_checkpoint_paths(tmp_path, capsys):
    missing = tmp_path / "missing.ckpt"
    out = str(tmp_path / "out")
    assert (
        export_error(capsys, "--ckpt_path", str(missing), "--out", out)
        == f"earl: error: `--ckpt_path`: checkpoint '{missing}' does not exist"
    )
    assert export_error(capsys, "--ckpt_path", str(tmp_path), "--out", out) == (
        f"earl: error: `--ckpt_path`: checkpoint '{tmp_path}' is a directory but not a distributed (DCP) checkpoint "
        "(no .metadata, no *.distcp shards); give a .ckpt file or a DCP checkpoint directory"
    )
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    assert export_error(capsys, "--ckpt_path", str(text), "--out", out) == (
        f"earl: error: `--ckpt_path`: checkpoint '{text}' is truncated or not a checkpoint file (16 bytes, no "
        "end-of-archive record): its save or copy was interrupted? Use an earlier checkpoint"
    )
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    assert export_error(capsys, "--ckpt_path", str(other), "--out", out) == (
        f"earl: error: `--ckpt_path`: checkpoint '{other}' is not a checkpoint of `earl fit` or `earl sft`: it names "
        "no model in its hyperparameters or holds no policy weights"
    )
    assert not Path(out).exists()


def test_out_must_be_new_or_empty_unless_overwrite(tmp_path, capsys):
    ckpt = fake_checkpoint(tmp_path / "fake.ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export_error(capsys, "--ckpt_path", str(ckpt), "--out", str(out)) == (
        f"earl: error: `--out` '{out}' exists and is not empty; pass --overwrite to replace it, or choose another "
        "directory"
    )
    assert export_error(capsys, "--ckpt_path", str(ckpt), "--out", str(ckpt)) == (
        f"earl: error: `--out` '{ckpt}' is a file; it must be a directory (new, empty, or with --overwrite)"
    )
    main(["export", "--ckpt_path", str(ckpt), "--out", str(out), "--overwrite"])
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fake.ckpt",
        "out",
    ]  # no temporary or old copy left


def test_model_that_moved_or_differs(tmp_path, capsys):
    ckpt = fake_checkpoint(tmp_path / "moved.ckpt", model=str(tmp_path / "gone" / "model"))
    line = export_error(capsys, "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out"))
    assert line.startswith(
        f"earl: error: `--ckpt_path's model (moved.ckpt: hyper_parameters.model)`: model path "
        f"'{tmp_path / 'gone' / 'model'}' does not exist."
    ), line
    main(
        ["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out"), "--model", "earl-tiny"]
    )
    assert (tmp_path / "out" / "model.safetensors").is_file()
    line = export_error(
        capsys, "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out4"), "--model", "earl-tiny-4l"
    )
    assert line.startswith(
        f"earl: error: `--ckpt_path`: checkpoint '{ckpt}' is from another model: "
    ), line
    assert line.endswith("(the model and the recipe must be those of the run that saved it)"), line


def test_required_arguments(capsys):
    code, err = run_earl(capsys, ["export", "--out", "x"])
    assert (
        code == 2
        and err.splitlines()[-1]
        == "earl export: error: the following arguments are required: --ckpt_path"
    )


def test_truncated_dcp_shard(two_processes, tmp_path, capsys):
    bad = tmp_path / "cut.ckpt"
    shutil.copytree(two_processes / "checkpoints" / "last.ckpt", bad)
    os.truncate(bad / "__1_0.distcp", 1000)
    line = export_error(capsys, "--ckpt_path", str(bad), "--out", str(tmp_path / "out"))
    assert line.startswith(
        f"earl: error: `--ckpt_path`: checkpoint '{bad}' is truncated: shard __1_0.distcp has "
        "1,000 bytes, its .metadata needs "
    ), line
    assert not (tmp_path / "out").exists()

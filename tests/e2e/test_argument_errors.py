"""An unknown key or a value of the wrong type is two lines, not the ~120-line usage (issue 45): the
key as written, the value, what is allowed (the closest valid keys), and where the full list is;
exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from earl_lightning.cli import main
from earl_lightning.cli.argument_errors import short_error
from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "connect4_ppo.yaml"
HINT = "earl: `earl fit --help` lists every option"


def earl_fit(*argv: str) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(Path(sys.executable).with_name("earl")), "fit", "--config", str(RECIPE), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        timeout=300,
    )


def test_an_unknown_key_is_two_lines():
    proc = earl_fit("--model.no_such_key", "3")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        (
            "earl: error: `--model.no_such_key` (given '3') is not an option; `--model` takes algorithm, dtype, "
            "logprob_mismatch_warn, model, no_signal_steps, optim, peft, rollout, seed, "
            "transcript_every_n_steps, transcripts"
        ),
        HINT,
    ]


@pytest.mark.parametrize(
    "argv, line",
    [
        # a value of the wrong type (an unknown key through a real `earl` process: above)
        (["--trainer.max_steps", "abc"], "`--trainer.max_steps`: 'abc' is not an int"),
        (
            ["--model.rollout.max_turnz", "3"],
            (
                "`--model.rollout.max_turnz` (given '3') is not an option; did you mean "
                "`--model.rollout.max_turns`?"
            ),
        ),
        (
            ["--trainre.max_steps=3"],
            (
                "`--trainre.max_steps` (given '3') is not an option; did you mean "
                "`--trainer.max_steps`?"
            ),
        ),
        # a key's prefix is not the key (argparse's abbreviations would have run `--trainer.max_steps 3`)
        (
            ["--trainer.max_step=3"],
            (
                "`--trainer.max_step` (given '3') is not an option; did you mean "
                "`--trainer.max_steps` or `--trainer.max_time` or `--trainer.min_steps`?"
            ),
        ),
        (
            ["--model.rollout.max_turn", "3"],
            (
                "`--model.rollout.max_turn` (given '3') is not an option; did you mean "
                "`--model.rollout.max_turns`?"
            ),
        ),
        (
            ["--model.dtype", "float8"],
            "`--model.dtype`: 'float8' is not one of 'float32', 'bfloat16', 'float16'",
        ),
        (["--model.peft", "3"], "`--model.peft`: '3' is not a LoraSettings or null"),
        # a key inside a group typed as a dataclass: the key itself, and the group's keys
        (
            ["--model.peft.rr", "8"],
            "`--model.peft.rr` (given '8') is not an option; did you mean `--model.peft.r`? "
            "`--model.peft` takes r, kwargs, dropout, target_modules, alpha",
        ),
        (["--model.peft.r", "x"], "`--model.peft.r`: 'x' is not an int"),
        (
            ["--data.dataset.eval_sise", "3"],
            "`--data.dataset.eval_sise` (given '3') is not an option; did you mean "
            "`--data.dataset.eval_size` or `--data.dataset.eval_split`? `--data.dataset` takes "
            "eval_size, eval_split, train_split, data_files, name, path",
        ),
    ],
)
def test_misspelt_keys_and_wrong_values_in_process(capsys, argv, line):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(RECIPE), *argv])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"earl: error: {line}", HINT]


def test_an_unknown_key_in_a_config_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  optim:\n    lrr: 0.1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(RECIPE), "--config", str(bad)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "earl: error: `--model.optim.lrr` (in a --config file) is not an option; did you mean `--model.optim.lr`?",
        HINT,
    ]


def test_an_unknown_key_of_a_group_in_a_config_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  peft:\n    rr: 8\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(RECIPE), "--config", str(bad)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "earl: error: `--model.peft.rr` is not an option; did you mean `--model.peft.r`? "
        "`--model.peft` takes r, kwargs, dropout, target_modules, alpha",
        HINT,
    ]


def test_an_unrecognised_message_is_kept_in_one_line():
    assert short_error("something\n  else  went wrong", []) == ["something else went wrong"]

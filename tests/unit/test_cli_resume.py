"""What `--ckpt_path` reports of a checkpoint's saved settings: the differences from the config, in one line."""

from __future__ import annotations

from earl_lightning.cli.resume import differences, differences_line


def test_differences_are_the_settings_both_name_with_other_values():
    saved = {
        "model": "old/path",
        "optim": {"lr": 0.1, "betas": (0.9, 0.99)},
        "tools": [],
        "gone": 1,
        "_x": "y",
    }
    config = {
        "model": "earl-tiny",
        "optim": {"lr": 0.1, "betas": [0.9, 0.99]},
        "tools": None,
        "new": 2,
        "_x": "z",
    }
    assert differences(saved, config, "--model") == [("--model.model", "old/path", "earl-tiny")]


def test_one_line_names_a_few_and_counts_the_rest():
    found = [(f"--model.k{i}", i, i + 1) for i in range(6)]
    line = differences_line("last.ckpt", found)
    assert line == (
        "earl: `--ckpt_path` 'last.ckpt' was saved with other settings; this run uses its config's: "
        "`--model.k0` 1 (saved: 0), `--model.k1` 2 (saved: 1), `--model.k2` 3 (saved: 2), "
        "`--model.k3` 4 (saved: 3) and 2 more"
    )
    assert differences_line("last.ckpt", []) is None

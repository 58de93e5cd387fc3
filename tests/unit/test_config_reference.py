"""docs/configuration.md is generated from the typed configs and must match them."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import config_reference  # noqa: E402


def test_configuration_reference_is_in_sync_with_the_code():
    assert config_reference.DOC.read_text() == config_reference.render(), (
        "docs/configuration.md is out of date: run python scripts/config_reference.py"
    )


def test_check_flag_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    monkeypatch.setattr(config_reference, "DOC", stale)
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    with pytest.raises(SystemExit, match="is out of date; run python scripts/config_reference.py"):
        config_reference.main()
    monkeypatch.setattr(sys, "argv", ["config_reference.py"])
    config_reference.main()
    assert stale.read_text() == config_reference.render()


def test_reference_lists_every_nested_setting_with_its_real_default():
    from earl_lightning.modules import OptimConfig, RolloutConfig

    text = config_reference.render()
    assert f"| `--model.optim.micro_batch_tokens` | `{OptimConfig().micro_batch_tokens}` |" in text
    assert (
        f"| `--model.rollout.sampling.max_new_tokens` | `{RolloutConfig().sampling.max_new_tokens}` |"
        in text
    )
    assert "| `--data.dispatch.tp_mode` | `auto` |" in text
    assert "| `--model.algorithm.kl.in_reward` | `false` |" in text


def test_args_section_parser_joins_continuation_lines():
    class Example:
        """Title.

        Args:
            alpha: first line
                continued here.
            beta: a | pipe.

        Returns: nothing.
        """

    assert config_reference.arg_docs(Example) == {
        "alpha": "first line continued here.",
        "beta": "a \\| pipe.",
    }


def test_a_setting_without_a_description_is_an_error():
    with pytest.raises(SystemExit, match="--x.gamma has no entry"):
        config_reference.rows_of("--x", [("gamma", 1)], {})

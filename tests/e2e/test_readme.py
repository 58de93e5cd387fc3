"""README.md is the user's manual and docs/guide.md its long form: what they show must work as
written. README's Python API example trains (2 steps here); every ``earl`` command of their shell
blocks and every flag of README's configuration section parses to the configuration it names; their
plug-in and adaptive-parallelism examples run; every link of README and docs/ reaches its file and
heading; every script command of README and docs/ names a script and flags that exist."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import yaml

import earl_lightning
from earl_lightning.cli import main
from tests.distributed.launch import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
MANUAL = (README, GUIDE)  # what the commands and examples below are read from
PLACEHOLDER = re.compile(r"<|\$|my_package|my_recipe")


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def python_blocks() -> list[str]:
    return [
        b for md in MANUAL for b in re.findall(r"```python\n(.*?)```", md.read_text(), flags=re.S)
    ]


def earl_commands() -> list[list[str]]:
    """Each ``earl`` command of README's and the guide's bash blocks and inline code, as argv after
    ``earl`` (continuations joined, ``&&`` chains split, comments dropped)."""
    out = []
    text = "\n".join(md.read_text() for md in MANUAL)
    shell = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    # inline commands
    shell += re.findall(r"`((?:\.venv/bin/)?earl (?:fit|validate|sft|export) [^`]+)`", prose)
    for block in shell:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                for i, w in enumerate(words):
                    if w.endswith("/earl") or w == "earl":
                        out.append(words[i + 1 :])
                        break
    return out


def test_python_api_example_trains(monkeypatch, tmp_path):
    api = next(
        b
        for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
        if "AgenticRLModule(" in b
    )
    made = []

    class TwoSteps(lightning.Trainer):  # the example as written, for 2 steps instead of 200
        def __init__(self, **kwargs):
            kwargs.update(
                max_steps=2,
                val_check_interval=2,
                default_root_dir=str(tmp_path),
                enable_progress_bar=False,
            )
            super().__init__(**kwargs)
            made.append(self)

    class SmallBatches(earl_lightning.EpisodeDataModule):
        """The example's data module as written, with 2 groups of 8 episodes a step (64 as
        written) and 16 evaluation games (128 by default): the same rollout, GAE and PPO code."""

        def __init__(self, **kwargs):
            kwargs.update(batch_size=16, eval_episodes=16)
            super().__init__(**kwargs)

    monkeypatch.setattr(lightning, "Trainer", TwoSteps)
    monkeypatch.setattr(earl_lightning, "EpisodeDataModule", SmallBatches)
    exec(compile(api, str(README), "exec"), {})
    trainer = made[0]
    assert isinstance(trainer.datamodule, SmallBatches) and trainer.global_step == 2
    assert 0.0 <= float(trainer.callback_metrics["val/win_rate"]) <= 1.0
    assert "reward/mean" in trainer.logged_metrics or "reward/mean" in trainer.callback_metrics


def _flag_values(argv: list[str]) -> dict[str, str]:
    flags = {}
    for flag, value in zip(argv, argv[1:] + [""]):
        if (
            flag.startswith(("--model.", "--data.", "--trainer."))
            and value
            and not value.startswith("--")
        ):
            flags[flag[2:]] = value
    return flags


def _check_print_config(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--print_config"])
    printed = capsys.readouterr()
    assert exc.value.code == 0, f"earl {shlex.join(argv)}: {printed.err[-2000:]}"
    cfg = yaml.safe_load(printed.out)
    for dotted, value in _flag_values(argv).items():
        got = cfg
        for key in dotted.split("."):
            got = got[key]
        assert got == _scalar(value) or str(got) == value, (
            dotted,
            got,
            value,
        )  # devices: str | int


def _scalar(value: str):
    """A flag's value as the CLI reads it (YAML, with ``5e-4`` a float as in YAML 1.2)."""
    try:
        return (
            float(value)
            if re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value)
            else yaml.safe_load(value)
        )
    except yaml.YAMLError:
        return value


def test_every_earl_command_in_readme_and_the_guide_parses(capsys):
    commands = [c for c in earl_commands() if not any(PLACEHOLDER.search(w) for w in c)]
    # the two main commands, every subcommand at a glance, warm start, several processes, vLLM
    assert len(commands) >= 15 and {c[0] for c in commands} >= {
        "fit",
        "validate",
        "sft",
        "export",
        "plan",
        "profile",
        "presets",
    }, commands
    for argv in commands:
        if argv[0] == "presets":  # the offline models' table: nothing is built
            from earl_lightning.models.presets import presets_command

            presets_command(argv[1:])
            assert "earl-tiny" in capsys.readouterr().out
            continue
        if argv[0] == "profile":  # its own parser too; the recipe must exist
            from earl_lightning.profiling.command import profile_parser

            assert (ROOT / profile_parser().parse_args(argv[1:]).config).is_file(), argv
            continue
        if argv[0] == "export":  # not LightningCLI: its own parser, no recipe
            from earl_lightning.checkpoints.export import export_parser

            export_parser().parse_args(argv[1:])
            continue
        if argv[0] == "plan":  # nor is plan: a config.json, a cluster and a recipe
            from earl_lightning.planning.command import plan_parser, settings_from

            ns = plan_parser().parse_args(argv[1:])
            assert (ROOT / ns.model).is_file() and (ROOT / ns.recipe).is_file(), argv
            settings_from(ns)
            continue
        assert argv[0] in ("fit", "validate", "sft"), argv
        assert (ROOT / argv[argv.index("--config") + 1]).is_file(), argv
        _check_print_config(argv, capsys)


def test_configuration_flags_in_readme_set_what_they_name(capsys):
    flags = [
        shlex.split(s)
        for s in re.findall(
            r"`(--(?:model|data|trainer)\.[^`]+)`", section("Recipes and configuration")
        )
    ]
    assert len(flags) >= 3, flags
    _check_print_config(
        ["fit", "--config", "recipes/connect4_grpo.yaml", *[w for f in flags for w in f]], capsys
    )


def _slugs(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    out, seen = set(), {}
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_links_of_readme_and_docs_reach_their_file_and_heading():
    files = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    broken, checked = [], 0
    for md in files:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            checked += 1
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert checked >= 50 and not broken, broken


def test_plugin_and_adaptive_examples_run_as_written(tmp_path):
    """The registration example registers its loss and estimator; the adaptive-parallelism example
    builds its Trainer (fitting needs the profile `earl profile` writes). In a fresh process: the
    registries are process-wide."""
    blocks = python_blocks()
    plugin = next(b for b in blocks if "@register_policy_loss" in b)
    adaptive = [  # README's short one and the guide's with a profile and a budget
        b if "trainer = Trainer(" in b else b.replace("Trainer(", "trainer = Trainer(", 1)
        for b in blocks
        if "AdaptiveParallelism(" in b
    ]
    assert len(adaptive) >= 2, adaptive
    built = "assert isinstance(trainer.strategy, EarlStrategy) and trainer.num_devices == 2\n"
    check = (
        "from earl_lightning.algorithms.losses import POLICY_LOSSES\n"
        "from earl_lightning.algorithms.estimators import ADVANTAGE_ESTIMATORS\n"
        "assert 'my_loss' in POLICY_LOSSES.names() and 'my_adv' in ADVANTAGE_ESTIMATORS.names()\n"
        "assert not ADVANTAGE_ESTIMATORS.get('my_adv', 'advantage').needs_values\n"
    )
    script = tmp_path / "examples.py"
    script.write_text(plugin + check + "".join(a + built for a in adaptive) + "print('ok')\n")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_scripts_and_flags_named_in_readme_and_docs_exist():
    """Every ``python benchmarks/… | scripts/….py`` command of README and docs/ names a script that
    exists, with flags the script defines (flags after a bare ``--`` go to ``earl`` and are left out)."""
    missing, checked = [], 0
    for md in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        text = md.read_text().replace("\\\n", " ")
        for script, rest in re.findall(r"python ((?:benchmarks|scripts)/\w+\.py)([^`\n]*)", text):
            source = ROOT / script
            checked += 1
            if not source.is_file():
                missing.append(f"{md.relative_to(ROOT)}: {script} (no such script)")
                continue
            code = source.read_text()
            words = rest.split("#")[0].split()
            for flag in words[: words.index("--")] if "--" in words else words:
                if flag.startswith("--") and f'"{flag}"' not in code and f"'{flag}'" not in code:
                    missing.append(f"{md.relative_to(ROOT)}: {script} {flag} (no such flag)")
    assert checked >= 30 and not missing, missing

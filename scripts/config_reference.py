"""Write docs/configuration.md: every setting of `earl fit`, its default and meaning, from the code.

    python scripts/config_reference.py            # rewrite docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 if the file is out of date

The table is read from the typed configs themselves (the dataclasses' fields and defaults, the
``Args:`` sections of their docstrings, ``AgenticRLModule`` and ``EpisodeDataModule``'s signatures),
so it cannot drift from the code; ``tests/unit/test_config_reference.py`` compares the file
with ``render()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

`earl fit | validate --config recipes/<recipe>.yaml` is LightningCLI: every setting below is a
nested flag (`--model.algorithm.loss.clip_high 0.28`, `--model.optim.lr 5e-4`,
`--data.dispatch.tp_mode direct`) or a key of the recipe's YAML, and `--print_config` prints a
recipe's whole resolved tree. In Python each group is a frozen dataclass (`RolloutConfig`,
`AlgorithmConfig`, `OptimConfig` in `earl_lightning.modules`; `DispatchConfig` in
`earl_lightning.dispatch.exchange`) for which a dict may stand. Every value is checked when the run is
built, before any work: a bad one fails in one line that names the setting as written here. A
parameter left `null` means the chosen function's own default (PPO's clip bounds are 0.2, GSPO's
~1e-4); one the chosen function does not take fails at start-up.

Generated from the code by `python scripts/config_reference.py` (a test keeps it in sync). The
recipes in `recipes/` set what differs from these defaults. `earl sft` (the warm start) has its own
`model:` / `data:` groups and arguments ([below](#earl-sft-the-warm-start)), shown by
`earl sft --config recipes/connect4_sft.yaml --print_config`.
"""

SFT_HEADER = """
## `earl sft` (the warm start)

`earl sft --config recipes/<task>_sft.yaml` fits on demonstrations, then saves the model and
tokenizer to `--output_dir` with `warm_start.json` (the held-out evaluation and the demonstrations'
figures); `earl fit --model.model <dir>` starts RL from it.

| setting | default | meaning |
| --- | --- | --- |"""


def arg_docs(obj) -> dict[str, str]:
    """``name -> description`` from the ``Args:`` section of ``obj``'s docstring."""
    doc = inspect.getdoc(obj) or ""
    if "Args:" not in doc:
        return {}
    out, name = {}, None
    for line in doc.split("Args:", 1)[1].splitlines():
        match = re.match(r"^    (\w+): ?(.*)$", line)
        if match:
            name, out[match.group(1)] = match.group(1), match.group(2).strip()
        elif name and line.startswith("        "):
            out[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return {k: " ".join(v.split()).replace("``", "`").replace("|", "\\|") for k, v in out.items()}


def show(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)) and not value:
        return f"`{value!r}`"
    return f"`{value}`"


REQUIRED = object()  # a group's field without a default


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:
        return REQUIRED
    return f.default_factory()  # type: ignore[misc]


def optional_group(annotation) -> type | None:
    """The dataclass inside an ``Optional[Union[Group, ...]]`` annotation (a group that may be unset)."""
    import typing

    for arg in typing.get_args(annotation):
        found = arg if dataclasses.is_dataclass(arg) else optional_group(arg)
        if found is not None:
            return found
    return None


def rows_of(
    prefix: str,
    params: list[tuple[str, object]],
    docs: dict[str, str],
    expand: bool = True,
    groups: dict[str, type] | None = None,
) -> list[str]:
    """Table rows for ``params``; a dataclass-valued one is expanded under its own prefix (with
    ``expand``; else one row that points to ``earl fit``'s table of the same group). ``groups``:
    parameters that default to null but may be given as a group (their settings are listed too)."""
    rows = []
    for name, default in params:
        flag = f"{prefix}.{name}"
        group = (groups or {}).get(name)
        if group is not None and default is None and expand:
            rows.append(f"| `{flag}` | `null` | {docs.get(name, '')} |")
            rows += rows_of(
                flag,
                [(f.name, field_default(f)) for f in dataclasses.fields(group)],
                arg_docs(group),
            )
        elif default is REQUIRED:
            rows.append(f"| `{flag}` | (required) | {docs[name]} |")
        elif dataclasses.is_dataclass(default) and not expand:
            rows.append(
                f"| `{flag}` | (group) | {docs.get(name, '')} Its settings and defaults are those of "
                f"`earl fit`'s `{flag}` (above). |"
            )
        elif dataclasses.is_dataclass(default):
            rows.append(f"| `{flag}` | (group) | {docs.get(name, '')} |")
            rows += rows_of(
                flag,
                [(f.name, field_default(f)) for f in dataclasses.fields(default)],
                arg_docs(type(default)),
            )
        else:
            doc = docs.get(name)
            if doc is None:
                raise SystemExit(f"error: {flag} has no entry in its docstring's Args: section")
            rows.append(f"| `{flag}` | {show(default)} | {doc} |")
    return rows


def signature_params(cls) -> list[tuple[str, object]]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [(p.name, p.default) for p in params if p.name != "self"]


def signature_groups(cls) -> dict[str, type]:
    import typing

    hints = typing.get_type_hints(cls.__init__)
    return {name: g for name, hint in hints.items() if (g := optional_group(hint)) is not None}


def render() -> str:
    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule

    parts = [HEADER]
    for title, prefix, cls in (
        ("`model:` (AgenticRLModule)", "--model", AgenticRLModule),
        ("`data:` (EpisodeDataModule)", "--data", EpisodeDataModule),
    ):
        parts.append(f"\n## {title}\n\n| setting | default | meaning |\n| --- | --- | --- |")
        parts += rows_of(prefix, signature_params(cls), arg_docs(cls), groups=signature_groups(cls))
    return "\n".join(parts + fit_rows() + export_rows() + sft_rows() + preset_rows()) + "\n"


FIT_HEADER = """
## `earl fit`'s own arguments

| argument | default | meaning |
| --- | --- | --- |"""

PRESETS_HEADER = """
## Offline presets (`--model.model earl-tiny...`)

Small Qwen2-architecture models with random weights, built on first use (no download) and cached
under `~/.cache/earl_lightning` (`EARL_CACHE_DIR`). `earl presets` prints this table; `earl presets
NAME` builds one and prints its `save_pretrained` directory, which any tool loads
(`AutoModelForCausalLM.from_pretrained(<dir>)`, `AutoTokenizer`, vLLM); in Python,
`earl_lightning.models.make_tiny_model(NAME)` returns the same path.

| preset | layers | hidden | heads | parameters | tokenizer | chat template | used by |
| --- | --- | --- | --- | --- | --- | --- | --- |"""


def fit_rows() -> list[str]:
    """``earl fit``'s arguments outside the groups."""
    from earl_lightning.cli.fit import DUMP_HELP

    return [FIT_HEADER, f"| `--dump_episodes` | `null` | {DUMP_HELP} |"]


def preset_rows() -> list[str]:
    from earl_lightning.models.tiny import preset_table

    return [PRESETS_HEADER] + [
        f"| `{r['name']}` | {r['layers']} | {r['hidden']} | {r['heads']} | {r['parameters']:,} | "
        f"{r['tokenizer']} | `{r['chat_template']}` | {r['use']} |"
        for r in preset_table()
    ]


EXPORT_HEADER = """
## `export:` (the trained model, at the end of `earl fit`)

`earl fit` ends by writing the policy as a `save_pretrained` directory (weights, config, generation
config, tokenizer with its chat template; sharded weights gathered, rank 0 writes, atomically) that
transformers and vLLM load ([guide](guide.md#taking-the-model-away)).

| setting | default | meaning |
| --- | --- | --- |"""

EXPORT_COMMAND_HEADER = """
## `earl export` (any checkpoint to a model directory)

`earl export --ckpt_path <checkpoint> --out <dir>` writes the same directory from a checkpoint of
`earl fit` (a `.ckpt` file, or the DCP directory EarlStrategy writes on several processes), rebuilding
the model it was trained from out of the checkpoint's saved hyperparameters.

| argument | default | meaning |
| --- | --- | --- |"""


def export_rows() -> list[str]:
    """``earl fit``'s ``export:`` group (the ExportModel callback) and ``earl export``'s arguments."""
    from earl_lightning.callbacks import ExportModel
    from earl_lightning.checkpoints.export import EXPORT_ARGS

    rows = [
        EXPORT_HEADER,
        *rows_of("--export", signature_params(ExportModel), arg_docs(ExportModel)),
        EXPORT_COMMAND_HEADER,
    ]
    for flag, spec in EXPORT_ARGS.items():
        default = "(required)" if spec.get("required") else show(spec.get("default", False))
        rows.append(f"| `--{flag}` | {default} | {spec['help']} |")
    return rows


def sft_rows() -> list[str]:
    """``earl sft``'s table: its own arguments, then its ``model:`` and ``data:`` groups."""
    from earl_lightning.cli.sft import SFT_ARGS
    from earl_lightning.sft import DemonstrationDataModule, WarmStartModule

    rows = [
        SFT_HEADER,
        f"| `--output_dir` | `null` | {SFT_ARGS['output_dir']} |",
        f"| `--overwrite` | `false` | {SFT_ARGS['overwrite']} |",
    ]
    for prefix, cls in (("--model", WarmStartModule), ("--data", DemonstrationDataModule)):
        rows += rows_of(prefix, signature_params(cls), arg_docs(cls), expand=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when docs/configuration.md is out of date"
    )
    args = parser.parse_args()
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            sys.exit(f"error: {DOC} is out of date; run python scripts/config_reference.py")
        return
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()

"""``earl presets``: the offline models a recipe names by ``--model.model earl-tiny...``, their sizes
and tokenizers; ``earl presets NAME`` builds one (once) and prints its ``save_pretrained``
directory, for any tool outside earl (``AutoModelForCausalLM.from_pretrained(<dir>)``)."""

from __future__ import annotations

import argparse

from earl_lightning.core import console
from earl_lightning.models.tiny import PRESETS, make_tiny_model, preset_table

COLUMNS = ("name", "layers", "hidden", "heads", "parameters", "tokenizer", "chat_template", "use")


def table_lines() -> list[str]:
    """The presets as a plain-text table, one a line."""
    rows = [{k: str(v) for k, v in r.items()} for r in preset_table()]
    for r in rows:
        r["parameters"] = f"{int(r['parameters']):,}"
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in COLUMNS[:-1]}
    line = lambda r: "  ".join(r[c].ljust(width[c]) for c in COLUMNS[:-1]) + "  " + r["use"]  # noqa: E731
    return [line({c: c for c in COLUMNS}), *map(line, rows)]


def presets_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="earl presets",
        description="The offline models (random weights, built here, no download): "
        "`--model.model NAME` in any recipe. With NAME: build it once and print its directory.",
    )
    parser.add_argument("name", nargs="?", help="a preset: print its save_pretrained directory")
    args = parser.parse_args(argv)
    if args.name is None:
        print("\n".join(table_lines()))
        print("\n`earl presets NAME` prints a preset's directory (built on first use).")
        return
    if args.name not in PRESETS:
        console.error(f"earl: error: unknown preset {args.name!r}; valid: {list(PRESETS)}")
        raise SystemExit(2)
    print(make_tiny_model(args.name))

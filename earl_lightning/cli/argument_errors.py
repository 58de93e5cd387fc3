"""An argument the ``earl`` command cannot take (an unknown key, a value of the wrong type) is a
short message: the key as the user wrote it, the value, what is allowed, and one line pointing at
``--help``; exit code 2. (jsonargparse prints the whole usage, ~120 lines, with the error last.)"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import typing
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from earl_lightning.core import console
from earl_lightning.core.lightning_internals import action_typehint, parser_actions


class ShortErrorParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are :func:`short_error` lines instead of the usage."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        # a parser that reports by raising (jsonargparse's own nested parses)
        if not self.exit_on_error:
            super().error(message, ex)
        # an error of `fit` found by the root parser
        parser = getattr(ex, "subcommand_parser", None) or self
        lines = short_error(message, options(parser))
        # `earl fit`, `earl sft`: the CLIs name their prog
        command = parser.prog.replace(" [options]", "")
        console.error(
            "\n".join(
                [
                    *(f"earl: error: {line}" for line in lines),
                    f"earl: `{command} --help` lists every option",
                ]
            )
        )
        raise SystemExit(2)


def options(parser: Any) -> list[str]:
    """Every ``--key`` the parser accepts, with the fields of a group typed as a dataclass or an
    ``Optional`` one (``--model.peft.r``: jsonargparse takes them, but lists no option for them)."""
    actions = parser_actions(parser)
    keys = {s for action in actions for s in action.option_strings if s.startswith("--")}
    for action in actions:
        hint = action_typehint(action)
        for kind in typing.get_args(hint) or (hint,):
            if dataclasses.is_dataclass(kind):
                keys |= {f"--{action.dest}.{f.name}" for f in dataclasses.fields(kind)}
    return sorted(keys)


def short_error(message: str, known: list[str]) -> list[str]:
    """jsonargparse's error ``message`` as at most a few lines naming the key and the value."""
    unknown = re.match(r"unrecognized arguments: (.*)", message, re.DOTALL)
    if unknown:
        words = unknown.group(1).split()
        key, _, value = next((w for w in words if w.startswith("--")), words[0]).partition("=")
        if not value and key in words and words.index(key) + 1 < len(words):
            value = words[words.index(key) + 1]
        return [unknown_key(key, value or None, known)]
    from_file = re.match(r"Subcommand '\w+' does not accept option '([^']+)'", message)
    if from_file:
        return [unknown_key(f"--{from_file.group(1)}", None, known, where=" (in a --config file)")]
    typed = re.match(r'Parser key "([^"]+)":\s*(.*)', message, re.DOTALL)
    if typed:
        in_group = group_key_error(typed.group(1), typed.group(2), known)
        return [in_group or f"`--{typed.group(1)}`: {wrong_value(typed.group(2))}"]
    return [" ".join(message.split())[:300]]


def group_key_error(dest: str, detail: str, known: list[str]) -> str | None:
    """A key inside a group typed as a dataclass (``--model.peft.rr 8``, or ``rr`` in a config
    file's ``peft:``): jsonargparse reports the group's value against each type of its union;
    the line names the key itself, the value, and what is allowed. None: not such an error."""
    given = re.search(r"Given value: NestedArg\(key='([^']+)', val=(.*)\)\s*$", detail, re.DOTALL)
    unknown = re.search(r"Option '([^']+)' is not accepted", detail)
    if unknown:
        name = unknown.group(1)
        value = _literal(given.group(2)) if given and given.group(1) == name else None
        return unknown_key(f"--{dest}.{name}", value, known, list_group=True)
    inner = re.search(r'Parser key "([^"]+)":\s*(.*?)(?=\n\s*- |\Z)', detail, re.DOTALL)
    if given and inner:
        return f"`--{dest}.{inner.group(1)}`: {wrong_value(inner.group(2))}"
    return None


def _literal(text: str) -> str:
    try:
        return str(ast.literal_eval(text.strip()))
    except (ValueError, SyntaxError):
        return text.strip()


def unknown_key(
    key: str, value: str | None, known: list[str], where: str = "", list_group: bool = False
) -> str:
    """The line for an option no parser group has, with the closest valid keys when there are some;
    ``list_group``: and every key of a small group, closest first."""
    given = f" (given {value!r})" if value is not None else ""
    parent, _, name = key.rpartition(".")
    siblings = [
        k
        for k in known
        if parent and k.startswith(parent + ".") and "." not in k[len(parent) + 1 :]
    ]
    # A misspelt last part among its group's keys, else a misspelt group (`--trainre.max_steps`).
    close = [
        f"{parent}.{k}"
        for k in difflib.get_close_matches(name, [k[len(parent) + 1 :] for k in siblings], n=3)
    ]
    close = close or difflib.get_close_matches(key, known, n=2, cutoff=0.85)
    names = [k[len(parent) + 1 :] for k in siblings]
    if list_group:  # a dataclass group's fields, not jsonargparse's `--group.help CLASS`
        names = [k for k in names if k != "help"]
    small = 0 < len(siblings) <= 12  # a small group (`--model`, not `--trainer`): its keys
    if list_group:
        names.sort(key=lambda k: -difflib.SequenceMatcher(None, name, k).ratio())
    hint = f"; did you mean {' or '.join(f'`{k}`' for k in close)}?" if close else ""
    if small and (list_group or not close):
        hint += f"{' ' if close else '; '}`{parent}` takes {', '.join(names)}"
    return f"`{key}`{where}{given} is not an option{hint}"


def wrong_value(detail: str) -> str:
    """jsonargparse's "Expected a <type>. Got value: V" (or a Union's list of errors) in one line:
    the value given and what is allowed."""
    simple = re.match(r"Expected a (.*?)\. Got value: (.*)", detail.strip(), re.DOTALL)
    if simple:
        return f"{simple.group(2).strip()!r} is not {allowed(simple.group(1))}"
    given = re.search(r"Given value: (.*)", detail)
    subtypes = re.search(r"Subtypes: \[(.*)\]", detail)
    if given and subtypes:
        kinds = [allowed(t) for t in re.split(r",\s*(?![^\[]*\])", subtypes.group(1))]
        return f"{given.group(1).strip()!r} is not {' or '.join(kinds)}"
    return " ".join(detail.split())[:300]


def allowed(type_text: str) -> str:
    """``<class 'int'>`` as "an int", ``typing.Literal['a', 'b']`` as "one of 'a', 'b'"."""
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", type_text.strip(), re.DOTALL)
    if literal:
        return f"one of {literal.group(1)}"
    plain = re.fullmatch(r"<class '(?:builtins\.)?([\w.]+)'>", type_text.strip())
    if plain:
        name = {
            "NoneType": "null",
            "int": "an int",
            "float": "a float",
            "bool": "true or false",
            "str": "a string",
        }.get(plain.group(1))
        return name or f"a {plain.group(1).rsplit('.', 1)[-1]}"
    return f"a {type_text.strip()}"

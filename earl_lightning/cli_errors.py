"""An argument the ``earl`` command cannot take (an unknown key, a value of the wrong type) is a
short message: the key as the user wrote it, the value, what is allowed, and one line pointing at
``--help``; exit code 2. (jsonargparse prints the whole usage, ~120 lines, with the error last.)"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser


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
        sys.stderr.write("".join(f"earl: error: {line}\n" for line in lines))
        sys.stderr.write(f"earl: `{command} --help` lists every option\n")
        sys.stderr.flush()
        raise SystemExit(2)


def options(parser: Any) -> list[str]:
    """Every ``--key`` the parser accepts."""
    return sorted(
        {s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    )


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
        return [f"`--{typed.group(1)}`: {wrong_value(typed.group(2))}"]
    return [" ".join(message.split())[:300]]


def unknown_key(key: str, value: str | None, known: list[str], where: str = "") -> str:
    """The line for an option no parser group has, with the closest valid keys when there are some."""
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
    if close:
        hint = f"; did you mean {' or '.join(f'`{k}`' for k in close)}?"
    elif 0 < len(siblings) <= 12:  # a small group (`--model`, not `--trainer`): its keys
        hint = f"; `{parent}` takes {', '.join(k[len(parent) + 1 :] for k in siblings)}"
    else:
        hint = ""
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

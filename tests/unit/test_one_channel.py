"""The package talks to its user through one channel, ``earl_lightning/core/console.py`` (the
``earl_lightning`` logger, rank zero aware): no other module prints, writes to stderr, makes its own
logger, calls Lightning's ``rank_zero_*`` or raises a warning other than a deprecation. ``print``
is kept where a command's output is the product, listed below with why."""

from __future__ import annotations

import ast
import builtins
import importlib
import logging
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "earl_lightning"
CONSOLE = PACKAGE / "core" / "console.py"
# (file, function): where ``print`` writes what the command is for, on stdout
PRINTS = {
    ("planning/command.py", "plan_command"): "`earl plan`'s tables and the files written",
    (
        "models/presets.py",
        "presets_command",
    ): "`earl presets`: the table, or the preset's directory",
    ("checkpoints/export.py", "export_checkpoint"): "`earl export`'s result: where the model is",
    ("profiling/command.py", "profile_command"): "`earl profile`'s measurements as they are taken",
    ("callbacks/export.py", "on_fit_end"): "`earl fit`'s result: where the trained model is",
    ("sft/save.py", "save_warm_start"): "`earl sft`'s result: where the warm start is",
    ("parallel/launch_env.py", "<module>"): "run as a script: the launcher's variables",
}
OTHER_CHANNELS = {"rank_zero_warn", "rank_zero_info", "rank_zero_debug", "getLogger"}


def _walk(tree: ast.AST):
    """(node, name of the innermost enclosing function or ``<module>``) for every node."""
    stack = [(tree, "<module>")]
    while stack:
        node, where = stack.pop()
        yield node, where
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]


def _module(path: Path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return importlib.import_module(".".join(rel.parts).removesuffix(".__init__"))


def _is_deprecation(call: ast.Call, names: dict) -> bool:
    category = call.args[1] if len(call.args) > 1 else None
    category = next((k.value for k in call.keywords if k.arg == "category"), category)
    if not isinstance(category, ast.Name):  # none given: a UserWarning
        return False
    found = names.get(category.id, getattr(builtins, category.id, None))
    return isinstance(found, type) and issubclass(found, DeprecationWarning)


def uses(path: Path, names: dict | None = None) -> list[tuple[str, str, int, str]]:
    """(kind, function, line, text) of each way ``path`` speaks to the user directly; ``names``:
    the module's namespace, where a warning's category is looked up (default: import it)."""
    names = vars(_module(path)) if names is None else names
    out = []
    for node, where in _walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name) and node.id == "print":
            out.append(("print", where, node.lineno, "print"))
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in OTHER_CHANNELS:
                out.append(("channel", where, node.lineno, name))
        if isinstance(node, ast.Attribute) and node.attr in ("stderr", "stdout"):
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                out.append(("channel", where, node.lineno, f"sys.{node.attr}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "warn"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "warnings"
        ):
            kind = "deprecation" if _is_deprecation(node, names) else "warning"
            out.append((kind, where, node.lineno, "warnings.warn"))
    return out


def _all_uses() -> list[tuple[str, str, str, int, str]]:
    return [
        (str(p.relative_to(PACKAGE)), *use)
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != CONSOLE
        for use in uses(p)
    ]


def test_no_module_speaks_to_the_user_but_through_the_console():
    found = _all_uses()
    bad = [
        f"earl_lightning/{file}:{line} ({where}): {text}"
        for file, kind, where, line, text in found
        if kind in ("channel", "warning") or (kind == "print" and (file, where) not in PRINTS)
    ]
    assert not bad, (
        "use earl_lightning.core.console (info / warn / error), or list a command's own output in "
        "PRINTS:\n" + "\n".join(bad)
    )


def test_the_check_sees_what_it_allows():
    """Not vacuous: the listed prints and the deprecation shims are found, and a plain warning,
    a print and a logger of a module's own would be flagged."""
    found = _all_uses()
    prints = {(file, where) for file, kind, where, _, _ in found if kind == "print"}
    assert prints == set(PRINTS), "a listed print is gone: drop it from PRINTS"
    deprecations = {file for file, kind, *_ in found if kind == "deprecation"}
    assert {"core/warnings_filter.py", "modules/transcripts.py"} <= deprecations


def test_a_bad_module_is_flagged(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import logging, sys, warnings\n"
        "log = logging.getLogger('x')\n"
        "def f():\n"
        "    print('hi')\n"
        "    sys.stderr.write('x')\n"
        "    warnings.warn('plain')\n"
    )
    kinds = sorted((kind, text) for kind, _, _, text in uses(bad, names={}))
    assert kinds == [
        ("channel", "getLogger"),
        ("channel", "sys.stderr"),
        ("print", "print"),
        ("warning", "warnings.warn"),
    ]


def test_console_is_rank_zero_and_one_logger(caplog):
    from lightning_utilities.core.rank_zero import rank_zero_only

    from earl_lightning.core import console

    before = getattr(rank_zero_only, "rank", None)
    with caplog.at_level(logging.INFO, logger="earl_lightning"):
        try:
            rank_zero_only.rank = 1
            console.info("shown on rank 0 only")
            console.warn("this rank's fault", every_rank=True)
            console.error("earl: error: ends this rank")
        finally:
            rank_zero_only.rank = before
        console.warn("rank 0 again")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("earl_lightning", "WARNING", "this rank's fault"),
        ("earl_lightning", "ERROR", "earl: error: ends this rank"),
        ("earl_lightning", "WARNING", "rank 0 again"),
    ]


def test_console_writes_each_message_as_it_is_to_stderr(capsys):
    from earl_lightning.core import console

    console.warn("earl: a line\nand its second line")
    assert capsys.readouterr().err == "earl: a line\nand its second line\n"

"""Lightning's privates (and LightningCLI's parser's: jsonargparse's, argparse's) are touched in one
module only, ``earl_lightning/core/lightning_internals.py``, each behind a function that says which
private and why no public API serves: a Lightning upgrade that renames one breaks there, not in a
strategy or a callback. The check reads the package's source and the libraries' own:

- an import of a ``_name`` from them, or of a ``._module`` of theirs;
- ``x._name`` (or ``getattr(x, "_name")``) where ``_name`` is a private the libraries define (a ``_function``, a ``_Class``, a
  ``self._attribute`` they assign) and ``x`` is not ``self`` / ``cls``;
- inside a class derived from one of theirs, ``self._name`` or ``def _name`` where ``_name`` is a
  private of a base of theirs (reading, setting or overriding the parent's private).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import inspect
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "earl_lightning"
ADAPTER = PACKAGE / "core" / "lightning_internals.py"
LIBRARIES = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning_utilities",
    "jsonargparse",
)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _library_files() -> list[Path]:
    files = [Path(argparse.__file__)]
    for name in LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            files += Path(spec.origin).parent.rglob("*.py")
    return files


def _defined(tree: ast.AST) -> set[str]:
    """The module- and class-level names a source defines, and every attribute it assigns."""
    names: set[str] = set()
    scopes = [tree]
    while scopes:
        scope = scopes.pop()
        for node in getattr(scope, "body", []):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                scopes.append(node)
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(target, ast.Name):
                    names.add(target.id)
    names |= {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
    }
    return {n for n in names if _private(n)}


@functools.cache
def library_privates() -> frozenset[str]:
    """The privates the libraries define, less torch's ``nn.Module`` state they also assign
    (Lightning's DeepSpeed strategy resets a module's ``_forward_hooks``: a torch private, which
    a Lightning upgrade cannot rename)."""
    import torch

    names: set[str] = set()
    for path in _library_files():
        try:
            names |= _defined(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):  # a template or a vendored file
            continue
    return frozenset(names - set(vars(torch.nn.Module())) - set(dir(torch.nn.Module)))


def _is_library(cls: type) -> bool:
    return cls.__module__.split(".")[0] in (*LIBRARIES, "argparse")


@functools.cache
def _base_privates(cls: type) -> frozenset[str]:
    """The privates ``cls``'s library bases define or assign (``self._x = ...`` in their code)."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not _is_library(base):
            continue
        names |= {n for n in vars(base) if _private(n)}
        try:
            names |= _defined(ast.parse(textwrap.dedent(inspect.getsource(base))))
        except (OSError, TypeError):
            continue
    return frozenset(names)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__"
    )


def _import_touches(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module.split(".")[0] not in LIBRARIES:
            return []
        if any(_private(part) for part in node.module.split(".")):
            return [f"from {node.module} import ..."]
        return [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
    if isinstance(node, ast.Import):
        return [
            f"import {a.name}"
            for a in node.names
            if a.name.split(".")[0] in LIBRARIES and any(_private(p) for p in a.name.split("."))
        ]
    return []


def _class_touches(module: object, cls_node: ast.ClassDef) -> list[tuple[int, str]]:
    cls = getattr(module, cls_node.name, None)
    if not isinstance(cls, type):
        return []
    privates = _base_privates(cls)
    out = []
    for node in ast.walk(cls_node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in privates:
            out.append((node.lineno, f"overrides {cls.__name__}'s parent's `{node.name}`"))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
            and node.attr in privates
        ):
            out.append((node.lineno, f"self.{node.attr} (a private of {cls.__name__}'s parent)"))
    return out


def touches(path: Path) -> list[str]:
    """Where ``path`` touches a private of the libraries, as ``file:line what``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    privates = library_privates()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        found += [(node.lineno, t) for t in _import_touches(node)]
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr in privates
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append((node.lineno, f".{node.attr}"))
        if (  # getattr(x, "_name"), setattr, hasattr
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in privates
        ):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    if classes:
        module = importlib.import_module(_module_name(path))
        for cls_node in classes:
            found += _class_touches(module, cls_node)
    rel = path.relative_to(PACKAGE.parent)
    return [f"{rel}:{line} {what}" for line, what in sorted(set(found))]


def test_lightning_privates_are_touched_in_the_adapter_only():
    outside = [t for p in sorted(PACKAGE.rglob("*.py")) if p != ADAPTER for t in touches(p)]
    assert not outside, (
        "a Lightning/jsonargparse private outside earl_lightning/core/lightning_internals.py "
        "(add a function there that says why no public API serves):\n" + "\n".join(outside)
    )


def test_the_check_sees_privates():
    """Not vacuous: the libraries' privates are read, and the adapter's own touches are found."""
    privates = library_privates()
    assert {"_checkpoint_connector", "_trainer", "_current_fx_name", "_run_subcommand"} <= privates
    assert {"_setup_distributed", "_actions"} <= privates
    adapter = "\n".join(touches(ADAPTER))
    for name in ("_trainer", "_current_fx_name", "_actions", "_typehint", "_setup_distributed"):
        assert name in adapter

"""Moved public modules keep working for one minor version: the old import path gives the new
module's very objects and warns once, with a ``DeprecationWarning`` that names the new path and
points at the user's import line. (pytest's config ignores DeprecationWarning, so each check runs
in a fresh interpreter with its own filters, where "once per process" can be seen too.)"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# old path -> (new path, a public name both give)
MOVED = {
    "earl_lightning.data.datamodule": ("earl_lightning.modules.datamodule", "EpisodeDataModule"),
    "earl_lightning.data.exchange": ("earl_lightning.dispatch.exchange", "DispatchConfig"),
    "earl_lightning.strategies.stage": ("earl_lightning.stages", "StageContext"),
    "earl_lightning.strategies.layouts": ("earl_lightning.parallel.layout", "LayoutSelector"),
}

RECORD = """
import importlib, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from {old} import {name} as first
    again = importlib.import_module("{old}")
    from {old} import {name} as second
new = importlib.import_module("{new}")
print(json.dumps({{
    "same": first is second is getattr(new, "{name}") and again is new,
    "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught
                 if issubclass(w.category, DeprecationWarning) and "{old}" in str(w.message)],
}}))
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_objects_and_warns_once(old):
    new, name = MOVED[old]
    proc = _python(RECORD.format(old=old, new=new, name=name))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["same"]
    assert len(out["warnings"]) == 1, out["warnings"]
    category, message, filename = out["warnings"][0]
    assert category == "DeprecationWarning"
    assert f"`{old}` moved to `{new}`" in message and "goes in 0.4" in message
    assert filename == "<string>"  # the user's import, not the shim or importlib


def test_the_readmes_old_example_import_warns_where_python_shows_it():
    """With Python's default filters a DeprecationWarning shows only when raised from ``__main__``:
    a user's script running last week's README line sees it."""
    proc = _python("from earl_lightning.data.datamodule import EpisodeDataModule")
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()
    assert any(
        "DeprecationWarning: `earl_lightning.data.datamodule` moved to `earl_lightning.modules.datamodule`"
        in line
        for line in last
    ), proc.stderr
    assert "Traceback" not in proc.stderr


def test_nothing_in_the_package_imports_a_deprecated_path():
    """The shims are for users; the package itself (and its tests, benchmarks and scripts) use the
    new paths, so removing the shims in 0.4 breaks nothing here."""
    hits = []
    for top in ("earl_lightning", "tests", "benchmarks", "scripts"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                hits += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n in MOVED]
    assert not hits, hits

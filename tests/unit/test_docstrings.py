"""The public API's modules pass ruff's docstring rules (D, Google convention, with the house-style
exceptions that pyproject.toml lists and explains). The modules are computed from
``earl_lightning.__all__``, so a new public name's module is covered without editing this test,
and a module that moves is followed to where it now lives. ``ruff check .`` does not select D:
the rest of the package (internals, tests, benchmarks) is not held to it."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import earl_lightning

ROOT = Path(__file__).resolve().parents[2]


def public_modules() -> list[Path]:
    """The package's ``__init__`` and the file defining each public name (its defining module, not
    the one it is re-exported from), relative to the repository root."""
    files = {Path(earl_lightning.__file__)}
    for name in earl_lightning.__all__:
        module = inspect.getmodule(getattr(earl_lightning, name))
        assert module is not None and module.__file__ is not None, name
        files.add(Path(module.__file__))
    return sorted(f.resolve().relative_to(ROOT) for f in files)


def ruff_command() -> list[str]:
    """The ruff installed beside this Python (the virtual environment's), else ``python -m ruff``."""
    beside = Path(sys.executable).parent / "ruff"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "ruff"]


def test_public_modules_pass_ruff_docstring_rules() -> None:
    files = [str(f) for f in public_modules()]
    proc = subprocess.run(
        [*ruff_command(), "check", "--select", "D", "--output-format", "concise", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"ruff check --select D on the public API modules:\n{proc.stdout}{proc.stderr}"
    )

"""Import a repository file that is not part of the package (a benchmark or a script) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_repo_file(relpath: str, name: str) -> ModuleType:
    """``relpath`` as a module; its own directory is on ``sys.path`` while it loads, as when it runs
    (so a script imports its siblings the same way in both)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module

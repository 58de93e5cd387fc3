"""Every file the README and docs/ name in code spans exists: a repository path (``scripts/x.py``,
``earl_lightning/rollout/loop.py``, or relative to the package as the design doc writes them,
``strategies/earl.py``), a ``path::name`` whose name is defined there, a file of the design doc's
package table under its row's package, and a file from history (``<commit>:path``) in that commit.
A file that moves or goes leaves no dangling name behind (``tests/e2e/test_readme.py`` checks the
links; this checks the names)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "earl_lightning"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FILE = re.compile(r"\.(py|yaml|yml|md|csv|png|json|jsonl|sh|toml)$")
HISTORY = re.compile(r"([0-9a-f]{7,40}):(\S+)$")
ROW = re.compile(r"^\| *\d+ *\| *(.*?) *\|")  # the design doc's table: | tier | package(s) | what |


def _expand(token: str) -> list[str]:
    """``a.{png,csv}`` -> ``a.png``, ``a.csv``."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m is None:
        return [token]
    return [
        x
        for alt in m.group(1).split(",")
        for x in _expand(token[: m.start()] + alt + token[m.end() :])
    ]


def _names(md: Path) -> Iterator[tuple[int, str, list[Path]]]:
    """(line, file name, the packages of its design-table row) of each code span naming a file;
    placeholders (``<NAME>``, ``$VAR``, ``my_*``) and bare extensions (``.jsonl``) are left out."""
    for lineno, line in enumerate(md.read_text().splitlines(), 1):
        row = ROW.match(line)
        packages = [PACKAGE / p for p in re.findall(r"`(\w+)/`", row.group(1))] if row else []
        for token in re.findall(r"`([^`\s]+)`", line):
            if re.search(r"[<$]|(^|/)my_", token):
                continue
            for name in _expand(token):
                if FILE.search(name.partition("::")[0]) and not name.startswith("."):
                    yield lineno, name, packages


def _exists(name: str, md: Path, packages: list[Path], tracked: set[str]) -> bool:
    path, _, attr = name.partition("::")
    if "/" not in path:
        if packages:  # a file of a package table row lives in that package, or at the top
            return any(any(p.rglob(path)) for p in packages) or (PACKAGE / path).exists()
        # elsewhere a bare name is either a module (`rl.py`) or a file a run writes (`config.json`)
        return not path.endswith(".py") or path in tracked
    for base in (ROOT, PACKAGE, md.parent, *packages):
        hits = sorted(base.glob(path))
        if hits:
            return not attr or bool(
                re.search(
                    rf"^\s*(def|class|async def) {re.escape(attr)}\b|^{re.escape(attr)}\b",
                    hits[0].read_text(),
                    flags=re.M,
                )
            )
    return False


def _tracked_names() -> set[str]:
    """The names of the project's Python files (not a virtual environment's or a run's)."""
    tops = ("earl_lightning", "tests", "scripts", "benchmarks", "recipes")
    return {p.name for top in tops for p in (ROOT / top).rglob("*.py")}


def test_every_file_named_in_readme_and_docs_exists():
    tracked = _tracked_names()
    dangling, checked = [], 0
    for md in DOCS:
        for lineno, name, packages in _names(md):
            if HISTORY.match(name):
                continue  # the next test
            checked += 1
            if not _exists(name, md, packages, tracked):
                dangling.append(f"{md.relative_to(ROOT)}:{lineno}: `{name}`")
    assert checked >= 300 and not dangling, "\n".join(dangling)


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
def test_every_file_from_history_is_in_its_commit():
    """``ba90600:scripts/probe_reading.py``: a removed script the docs quote figures of, named
    with the commit that has it."""
    missing, checked = [], 0
    for md in DOCS:
        for lineno, name, _ in _names(md):
            m = HISTORY.match(name)
            if m is None:
                continue
            checked += 1
            found = subprocess.run(
                ["git", "cat-file", "-e", f"{m.group(1)}:{m.group(2)}"],
                cwd=ROOT,
                capture_output=True,
            )
            if found.returncode != 0:
                missing.append(f"{md.relative_to(ROOT)}:{lineno}: `{name}`")
    assert checked >= 5 and not missing, "\n".join(missing)


def test_a_dangling_name_is_found(tmp_path):
    """The design doc's old slip, `checkpointing.py` under `strategies/`, and a moved script."""
    md = tmp_path / "design.md"
    md.write_text(
        "| 4 | `strategies/` | `EarlStrategy` (`earl.py`), saving (`checkpointing.py`) |\n"
        "Run `scripts/probe_reading.py` or `modules/views.py::no_such_function`.\n"
    )
    names = list(_names(md))
    tracked = _tracked_names()
    assert [n for _, n, p in names if not _exists(n, md, p, tracked)] == [
        "checkpointing.py",
        "scripts/probe_reading.py",
        "modules/views.py::no_such_function",
    ]

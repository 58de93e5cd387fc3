"""Moved public modules keep working for one minor version: the old import path gives the new
module's very objects and warns once, with a ``DeprecationWarning`` that names the new path and
points at the user's import line. (pytest's config ignores DeprecationWarning, so the checks run
in processes of their own with Python's own filters, where "once per process" can be seen too.)"""

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
    # the top level's loose modules, moved into packages by role in 0.3.0
    "earl_lightning.checks": ("earl_lightning.core.checks", "check_count"),
    "earl_lightning.errors": ("earl_lightning.core.errors", "EarlError"),
    "earl_lightning.seeding": ("earl_lightning.core.seeding", "run_seed"),
    "earl_lightning.groups": ("earl_lightning.core.config_groups", "coerce"),
    "earl_lightning.registry": ("earl_lightning.core.registry", "Registry"),
    "earl_lightning.algorithms.registry": ("earl_lightning.core.registry", "Registry"),
    "earl_lightning.host_memory": ("earl_lightning.core.host_memory", "trim_host_memory"),
    "earl_lightning.console": ("earl_lightning.core.console", "warn"),
    "earl_lightning.lightning_internals": (
        "earl_lightning.core.lightning_internals",
        "join_processes",
    ),
    "earl_lightning.warnings_filter": (
        "earl_lightning.core.warnings_filter",
        "install_warning_filters",
    ),
    "earl_lightning.checkpoints_io": ("earl_lightning.checkpoints.io", "AtomicCheckpointIO"),
    "earl_lightning.checkpoint_loaders": ("earl_lightning.checkpoints.loaders", "load_dcp"),
    "earl_lightning.checkpoint_urls": ("earl_lightning.checkpoints.urls", "download_checkpoint"),
    "earl_lightning.export": ("earl_lightning.checkpoints.export", "export_command"),
    "earl_lightning.cli_errors": ("earl_lightning.cli.argument_errors", "ShortErrorParser"),
    "earl_lightning.cli_resume": ("earl_lightning.cli.resume", "differences"),
    "earl_lightning.fit_cli": ("earl_lightning.cli.fit", "EarlCLI"),
    "earl_lightning.sft_cli": ("earl_lightning.cli.sft", "sft"),
    "earl_lightning.datamodule": ("earl_lightning.modules.datamodule", "EpisodeDataModule"),
    # "data" named four things until 0.3.0: the batch types are `batches/` now
    "earl_lightning.data.episodes": ("earl_lightning.batches.episodes", "episodes_to_experience"),
    "earl_lightning.data.experience": ("earl_lightning.batches.experience", "ExperienceBatch"),
    "earl_lightning.sft.data": ("earl_lightning.sft.datamodule", "DemonstrationDataModule"),
}

# a module that became a package of its name: (package, a name of the old module) -> its new module
MOVED_NAMES = {
    ("earl_lightning.checkpoints", "write_dir_atomically"): "earl_lightning.checkpoints.files",
    ("earl_lightning.checkpoints", "read_dcp_metadata"): "earl_lightning.checkpoints.files",
    ("earl_lightning.cli", "own_command"): "earl_lightning.cli.entry",
    ("earl_lightning.cli", "DUMP_HELP"): "earl_lightning.cli.entry",
}

# Each old path imported in one interpreter, each in its own record (a shim warns at its own
# import, whatever was imported before); the import is code of "<string>", as a user's script.
RECORD = """
import importlib, json, sys, warnings
out = {}
for old, new, name in json.loads(sys.argv[1]):
    ns = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from {old} import {name} as first", ns)
        again = importlib.import_module(old)
        exec(f"from {old} import {name} as second", ns)
    module = importlib.import_module(new)
    out[old] = {
        "same": ns["first"] is ns["second"] is getattr(module, name) and again is module,
        "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught
                     if issubclass(w.category, DeprecationWarning) and f"`{old}`" in str(w.message)],
    }
print(json.dumps(out))
"""


# Each check's script runs as `python -c SCRIPT ARG` would, in a child forked from one interpreter
# that imported the third-party packages the package imports (torch, Lightning, transformers: ~7 s
# of CPU an interpreter, paid once instead of once a check) and no module of the package: each child
# imports the package, and meets every old path, for the first time, with Python's default warning
# filters, `__main__` as the running module, "<string>" as its file and its own stdout and stderr.
FORKED = """
import json, os, sys, tempfile, traceback, warnings
filters = list(warnings.filters)
import jsonargparse, lightning.pytorch, torch, torchmetrics, transformers
assert not [m for m in sys.modules if m.startswith("earl_lightning")], "the package is imported"
# the filters these packages add are for their own warnings: none could take a shim's
added = [f for f in warnings.filters if f not in filters]
assert filters == [f for f in warnings.filters if f in filters], added
assert not [
    f for f in added if issubclass(DeprecationWarning, f[2]) and (not f[1] or f[1].match("`earl"))
], added
results = {}
for name, code, *args in json.loads(sys.argv[1]):
    sys.stdout.flush(), sys.stderr.flush()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
            sys.argv, exit_code = ["-c", *args], 0
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except BaseException:
                traceback.print_exc()
                exit_code = 1
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(exit_code)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out.seek(0), err.seek(0)
        results[name] = {"returncode": status, "stdout": out.read(), "stderr": err.read()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def checked() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every check's script run (as above): its name -> (exit code, stdout, stderr)."""
    cases = [
        ["records", RECORD, json.dumps([[o, n, name] for o, (n, name) in sorted(MOVED.items())])],
        ["names", RECORD_NAME, json.dumps([[p, n, MOVED_NAMES[p, n]] for p, n in NAMES])],
        ["readme", README_LINE],
        ["own", OWN_NAMES],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", FORKED, json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    return {
        name: subprocess.CompletedProcess(name, r["returncode"], r["stdout"], r["stderr"])
        for name, r in out.items()
    }


@pytest.fixture(scope="module")
def records(checked) -> dict[str, dict]:
    proc = checked["records"]
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_objects_and_warns_once(old, records):
    new, _ = MOVED[old]
    out = records[old]
    assert out["same"]
    assert len(out["warnings"]) == 1, out["warnings"]
    category, message, filename = out["warnings"][0]
    assert category == "DeprecationWarning"
    assert f"`{old}` moved to `{new}`" in message and "goes in 0.4" in message
    assert filename == "<string>"  # the user's import, not the shim or importlib


README_LINE = "from earl_lightning.data.datamodule import EpisodeDataModule"


def test_the_readmes_old_example_import_warns_where_python_shows_it(checked):
    """With Python's default filters a DeprecationWarning shows only when raised from ``__main__``:
    a user's script running last week's README line sees it."""
    proc = checked["readme"]
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()
    assert any(
        "DeprecationWarning: `earl_lightning.data.datamodule` moved to `earl_lightning.modules.datamodule`"
        in line
        for line in last
    ), proc.stderr
    assert "Traceback" not in proc.stderr


def _imported(node: ast.AST) -> list[str]:
    """What an import statement names: modules, and ``module.name`` for each name imported from
    a module (``from earl_lightning import checks`` names ``earl_lightning.checks``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


def _deprecated(name: str) -> bool:
    """An old module path, or a moved name of a module that became a package (not the package's
    own names, ``earl_lightning.cli.main``, nor its modules)."""
    if name in MOVED:
        return True
    package, _, attr = name.rpartition(".")
    own = {"main", "EarlCLI"} if package == "earl_lightning.cli" else set()
    folder = ROOT.joinpath(*package.split("."))
    return (
        package in {p for p, _ in MOVED_NAMES}
        and attr not in own
        and not (folder / f"{attr}.py").is_file()
        and not (folder / attr).is_dir()
    )


def test_nothing_in_the_package_imports_a_deprecated_path():
    """The shims are for users; the package itself (and its tests, benchmarks and scripts) use the
    new paths, so removing the shims in 0.4 breaks nothing here."""
    hits = []
    for top in ("earl_lightning", "tests", "benchmarks", "scripts"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                hits += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                    for name in _imported(node)
                    if _deprecated(name)
                ]
    assert not hits, hits


def test_a_deprecated_import_is_found():
    tree = ast.parse(
        "from earl_lightning import checks\n"
        "from earl_lightning.checkpoints import files, write_dir_atomically\n"
        "from earl_lightning.cli import main, say\n"
        "import earl_lightning.fit_cli\n"
    )
    found = [n for node in ast.walk(tree) for n in _imported(node) if _deprecated(n)]
    assert found == [
        "earl_lightning.checks",
        "earl_lightning.checkpoints.write_dir_atomically",
        "earl_lightning.cli.say",
        "earl_lightning.fit_cli",
    ]


RECORD_NAME = """
import importlib, json, sys, warnings
out = []
for package, name, new in json.loads(sys.argv[1]):
    ns = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from {package} import {name} as first", ns)
        exec(f"from {package} import {name} as second", ns)
        third = getattr(importlib.import_module(package), name)
    out.append({
        "same": ns["first"] is ns["second"] is third is getattr(importlib.import_module(new), name),
        "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught
                     if issubclass(w.category, DeprecationWarning)],
    })
print(json.dumps(out))
"""


NAMES = sorted(MOVED_NAMES)


@pytest.fixture(scope="module")
def name_records(checked) -> dict[tuple[str, str], dict]:
    proc = checked["names"]
    assert proc.returncode == 0, proc.stderr
    return dict(zip(NAMES, json.loads(proc.stdout.splitlines()[-1])))


@pytest.mark.parametrize("package,name", sorted(MOVED_NAMES))
def test_a_name_of_a_module_that_became_a_package_still_imports_and_warns_once(
    package, name, name_records
):
    new = MOVED_NAMES[package, name]
    out = name_records[package, name]
    assert out["same"]
    assert len(out["warnings"]) == 1, out["warnings"]
    category, message, filename = out["warnings"][0]
    assert category == "DeprecationWarning"
    assert f"`{package}.{name}` moved to `{new}.{name}`" in message and "goes in 0.4" in message
    assert filename == "<string>"


OWN_NAMES = """
import importlib, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from earl_lightning.cli import EarlCLI, main
    from earl_lightning.cli import argument_errors, entry, fit
    from earl_lightning.checkpoints import export, files, io, loaders, urls
    import earl_lightning.checkpoints as checkpoints
    try:
        checkpoints.no_such_name
        missing = None
    except AttributeError as err:
        missing = str(err)
print(json.dumps({
    "main": main is entry.main and EarlCLI is fit.EarlCLI,
    "missing": missing,
    "warnings": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
}))
"""


def test_the_packages_own_names_and_modules_do_not_warn(checked):
    """``earl_lightning.cli:main`` (the console script) and ``EarlCLI`` are the ``cli`` package's
    own names, and a package's modules are no moved names; an unknown name is an AttributeError."""
    proc = checked["own"]
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {
        "main": True,
        "missing": "module 'earl_lightning.checkpoints' has no attribute 'no_such_name'",
        "warnings": [],
    }

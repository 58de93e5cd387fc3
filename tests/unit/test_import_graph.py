"""The layering of docs/design.md, read from the source: nothing imports upward, no package cycle,
and ``modules/`` makes no raw ``torch.distributed`` call (collectives live in ``parallel/collectives.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "earl_lightning"
DESIGN = PACKAGE.parent / "docs" / "design.md"
# tier of each top-level unit of the package; a unit may import its own tier or lower ones.
# docs/design.md's "Layers" table says the same (test_the_design_docs_tier_table_is_this_one)
TIERS = {
    "core": 0,
    "algorithms": 1,
    "envs": 1,
    "tasks": 1,
    "models": 1,
    "rollout": 2,
    "batches": 2,
    "checkpoints": 2,
    "parallel": 2,
    "dispatch": 3,
    "train": 3,
    "stages": 3,
    "strategies": 4,
    "callbacks": 4,
    "modules": 4,
    "sft": 4,
    "profiling": 4,
    "planning": 4,
    "cli": 4,
    "__init__": 4,
}
# The top level's modules until 0.3.0, deprecation shims until 0.4: aliases of the modules that
# moved, not units of a layer (each imports only core.warnings_filter, and nothing imports them:
# tests/unit/test_deprecated_paths.py), so they have no tier and no row in docs/design.md.
SHIMS = {
    "checks",
    "errors",
    "seeding",
    "groups",
    "registry",
    "host_memory",
    "warnings_filter",
    "console",
    "lightning_internals",
    "checkpoints_io",
    "checkpoint_loaders",
    "checkpoint_urls",
    "export",
    "cli_errors",
    "cli_resume",
    "fit_cli",
    "sft_cli",
    "datamodule",
    "data",  # a package of shims: batches/, modules.datamodule, dispatch.exchange
}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> list[tuple[str, str, int]]:
    """(importing unit, imported unit, line) for every import of the package inside the package,
    lazy (function-level) imports included."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        unit = unit_of(".".join(rel.parts))
        if unit in SHIMS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from earl_lightning import checkpoints` imports that unit, not the package's
                # __init__ (which names every public class, so it would seem to close a cycle)
                names = [
                    _module_of(f"{node.module}.{a.name}") or node.module
                    if node.module == "earl_lightning"
                    else node.module
                    for a in node.names
                ]
            for name in names:
                if name == "earl_lightning" or name.startswith("earl_lightning."):
                    out.append((f"{unit} ({rel})", unit_of(name), node.lineno))
    return out


def test_every_unit_has_a_tier():
    units = {
        unit_of(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts))
        for p in PACKAGE.rglob("*.py")
    }
    assert units - SHIMS <= set(TIERS), (
        f"units without a tier: {sorted(units - SHIMS - set(TIERS))}"
    )
    assert not SHIMS & set(TIERS), "a unit is a shim or a layer's, not both"


def test_the_shims_are_shims():
    """A unit skipped as a shim is one: its module only makes the old path the new module."""
    for name in sorted(SHIMS):
        package = PACKAGE / name
        if package.is_dir():  # a package of shims: its __init__ a docstring, each module a shim
            init = ast.parse((package / "__init__.py").read_text()).body
            assert [type(n) for n in init] == [ast.Expr], name
            for module in sorted(package.glob("*.py")):
                if module.name != "__init__.py":
                    _assert_a_shim(module)
            continue
        _assert_a_shim(PACKAGE / f"{name}.py")


def _assert_a_shim(path: Path) -> None:
    tree = ast.parse(path.read_text())
    calls = [
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    ]
    assert calls == ["moved_module"] and len(tree.body) == 3, path  # docstring, import, call


def test_nothing_imports_upward():
    upward = [
        f"{src}:{line} imports {dst}"
        for src, dst, line in imports()
        if TIERS[dst] > TIERS[src.split(" ")[0]]
    ]
    assert not upward, "\n".join(upward)


def test_no_cycle_between_units():
    edges: dict[str, set[str]] = {}
    for src, dst, _ in imports():
        unit = src.split(" ")[0]
        if unit != dst:
            edges.setdefault(unit, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(
            n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ())
        )

    cycles = sorted({(a, b) for a, bs in edges.items() for b in bs if reaches(b, a, {b})})
    assert not cycles, f"units that import each other (directly or not): {cycles}"


def test_modules_make_no_raw_distributed_call():
    pattern = re.compile(r"torch\.distributed|dist\.(all_|broadcast|barrier)")
    hits = [
        f"{p.name}:{i}: {line.strip()}"
        for p in (PACKAGE / "modules").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_the_graph_is_really_read():
    found = {(src.split(" ")[0], dst) for src, dst, _ in imports()}
    assert ("modules", "algorithms") in found and ("parallel", "algorithms") in found


def _module_of(name: str) -> str | None:
    """The project module ``name`` is (a package is its ``__init__``), or None."""
    path = PACKAGE.parent / name.replace(".", "/")
    if path.with_suffix(".py").is_file():
        return name
    return name if (path / "__init__.py").is_file() else None


def test_no_cycle_between_modules():
    """Within a package too: no module imports one that imports it back (directly or not; lazy
    imports included), e.g. the backends' protocol and its concrete backends."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [_module_of(f"{node.module}.{a.name}") or node.module for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = _module_of(name) if name.startswith("earl_lightning") else None
                if target is not None and target != rel:
                    edges.setdefault(rel, set()).add(target)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(
            n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ())
        )

    cycles = sorted(
        (a, b)
        for a, bs in edges.items()
        for b in bs
        if not a.startswith(b + ".") and not b.startswith(a + ".") and reaches(b, a, {b})
    )
    assert not cycles, f"modules that import each other: {cycles}"


def tiers_of_design_doc(text: str) -> dict[str, int]:
    """The "Layers" table of docs/design.md as ``{unit: tier}``: each row is ``| tier | units |
    what |``, a unit a code span of the second cell (`rollout/` or `cli.py`)."""
    out = {}
    layers = text.partition("\n## Layers\n")[2].partition("\n## ")[0]
    for tier, units in re.findall(r"^\| *(\d+) *\| *(.*?) *\|", layers, flags=re.M):
        for span in re.findall(r"`([^`]+)`", units):
            out[span.removesuffix("/").removesuffix(".py")] = int(tier)
    return out


def tier_table_diff(doc: dict[str, int], code: dict[str, int]) -> list[str]:
    """What the doc's table and the test's ``TIERS`` disagree on, one line per unit."""
    return [
        f"{unit}: docs/design.md {doc.get(unit, 'has no row')}, TIERS {code.get(unit, 'has none')}"
        for unit in sorted(doc.keys() | code.keys())
        if doc.get(unit) != code.get(unit)
    ]


def test_the_design_docs_tier_table_is_this_one():
    """The doc's table is what this test enforces: a unit added, moved or dropped in one is in the
    other too (the package's ``__init__`` has no row: it names the public API, at the top)."""
    code = {unit: tier for unit, tier in TIERS.items() if unit != "__init__"}
    diff = tier_table_diff(tiers_of_design_doc(DESIGN.read_text()), code)
    assert not diff, "docs/design.md's tier table and TIERS differ:\n" + "\n".join(diff)


def test_a_tier_table_slip_is_found():
    doc = tiers_of_design_doc(
        "# Design\n\n## Layers\n\n| tier | package | what |\n| --- | --- | --- |\n"
        "| 0 | `registry.py`, `errors.py` | registries (`tiny.py`) |\n"
        "| 3 | `rollout/` | the loop |\n\n## Tests\n\n| 1 | `unit/` | not a layer |\n"
    )
    assert doc == {"registry": 0, "errors": 0, "rollout": 3}
    assert tier_table_diff(doc, {"registry": 0, "rollout": 2, "data": 2}) == [
        "data: docs/design.md has no row, TIERS 2",
        "errors: docs/design.md 0, TIERS has none",
        "rollout: docs/design.md 3, TIERS 2",
    ]

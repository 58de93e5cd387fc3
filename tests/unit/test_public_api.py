"""The public API: the names ``earl_lightning`` exports, pinned. Removing or renaming one breaks
users' scripts, so it is a deliberate edit of this list (and a deprecation shim, and a CHANGELOG
line), never a side effect of moving a module. ``import earl_lightning`` stays cheap: each name is
imported on first use."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import earl_lightning

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = [
    "AgenticRLModule",
    "RolloutConfig",
    "SamplingOptions",
    "AlgorithmConfig",
    "AdvantageConfig",
    "LossConfig",
    "KLConfig",
    "ValueConfig",
    "OptimConfig",
    "EpisodeDataModule",
    "DatasetConfig",
    "DispatchConfig",
    "WarmStartModule",
    "DemonstrationDataModule",
    "EarlStrategy",
    "AdaptiveParallelism",
    "StepProgressBar",
    "ExportModel",
    "Env",
    "ToolEnv",
    "StepResult",
    "register_env",
    "make_env",
    "env_names",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ParsedTurn",
    "register_tool_parser",
    "register_policy_loss",
    "PolicyLossStats",
    "register_advantage_estimator",
    "AdvantageInputs",
    "AdvantageOutput",
    "Moments",
    "make_tiny_model",
]


def test_the_public_names_are_pinned():
    assert earl_lightning.__all__ == PUBLIC
    assert len(set(PUBLIC)) == len(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_each_name_resolves_to_the_object_of_its_module(name):
    value = getattr(earl_lightning, name)
    module = importlib.import_module(earl_lightning._WHERE[name])
    assert value is getattr(module, name)
    assert value.__module__.startswith("earl_lightning."), (name, value.__module__)


def test_the_lazy_table_and_the_type_checkers_imports_agree():
    """``_WHERE`` (what runs) and the ``if TYPE_CHECKING:`` imports (what IDEs read) name the same
    objects in the same modules, and cover exactly ``__all__``."""
    tree = ast.parse((ROOT / "earl_lightning" / "__init__.py").read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    imported = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == earl_lightning._WHERE
    assert set(earl_lightning._WHERE) == set(PUBLIC)


def test_dir_and_star_import_list_the_public_names():
    assert set(PUBLIC) <= set(dir(earl_lightning))
    namespace: dict[str, object] = {}
    exec("from earl_lightning import *", namespace)
    assert set(PUBLIC) <= set(namespace)


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(
        AttributeError, match="module 'earl_lightning' has no attribute 'AgenticModule'"
    ):
        earl_lightning.AgenticModule  # noqa: B018


def test_import_is_cheap():
    """``import earl_lightning`` alone imports neither torch nor Lightning nor transformers (so
    the ``earl`` command's start and a rollout worker pay only for what they use); naming a public
    class then imports what it needs."""
    code = (
        "import sys, json, earl_lightning; heavy = lambda: sorted(m for m in ('torch', "
        "'torch.distributed', 'lightning', 'lightning.pytorch', 'transformers') if m in sys.modules); "
        "before = heavy(); earl_lightning.EarlStrategy; print(json.dumps([before, heavy()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    before, after = json.loads(out.splitlines()[-1])
    assert before == []
    assert "lightning.pytorch" in after and "torch.distributed" in after

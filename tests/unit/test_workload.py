"""What the memory model sizes (:class:`Workload`) is made from the run's configuration groups in
one place (``workload_view``), so its values are the groups' and it has no defaults of its own to
drift from theirs: the module's workload and ``earl plan``'s, for the same recipe, are equal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from earl_lightning.modules import AgenticRLModule, RolloutConfig
from earl_lightning.parallel.memory import Workload
from earl_lightning.planning.inputs import read_recipe

ROOT = Path(__file__).parents[2]


def test_a_workload_has_no_defaults_of_its_own():
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(Workload))
    with pytest.raises(TypeError):
        Workload()  # type: ignore[call-arg]


def test_the_module_workload_is_its_groups_values():
    module = AgenticRLModule(
        rollout={"max_context_tokens": 1536, "reuse_kv": False, "sampling": {"max_new_tokens": 24}},
        algorithm={"kl": {"coef": 0.05}},
        optim={"micro_batch_tokens": 3072, "scored_last_layer": False},
    )
    r, o = module.rollout_config, module.optim_config
    assert module.workload == Workload(
        backend=r.backend,
        max_context_tokens=r.max_context_tokens,
        max_new_tokens=r.sampling.max_new_tokens,
        micro_batch_tokens=o.micro_batch_tokens,
        reference_model=True,  # a KL and no LoRA: a frozen reference model
        reuse_kv=r.reuse_kv,
        scored_last_layer=False,
    )
    assert (module.workload.max_new_tokens, module.workload.micro_batch_tokens) == (24, 3072)


def test_default_groups_give_the_groups_defaults():
    work = AgenticRLModule().workload
    assert work.max_new_tokens == RolloutConfig().sampling.max_new_tokens
    assert work.max_context_tokens == RolloutConfig().max_context_tokens


def test_earl_plan_reads_the_workload_the_run_declares(tmp_path):
    """``earl plan --recipe`` sizes what ``earl fit`` with that recipe sizes."""
    cfg = yaml.safe_load((ROOT / "recipes" / "connect4_ppo.yaml").read_text())
    model = cfg["model"]
    model["rollout"] = {**model.get("rollout", {}), "max_context_tokens": 777}
    model["rollout"]["sampling"] = {**model["rollout"].get("sampling", {}), "max_new_tokens": 5}
    model["optim"] = {**model.get("optim", {}), "micro_batch_tokens": 999}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    module = AgenticRLModule(**model)
    module.configure_model()  # whether the model can take the scored last layer
    planned = read_recipe(str(path)).workload
    assert planned == module.workload
    assert (planned.max_context_tokens, planned.max_new_tokens, planned.micro_batch_tokens) == (
        777,
        5,
        999,
    )

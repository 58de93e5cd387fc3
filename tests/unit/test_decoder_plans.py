"""Decoder blocks and tensor-parallel plans read from the model: every tested family maps, a model
without a plan (GPT-2) is refused tp > 1 in one line (directly and at the strategy's setup check),
and ``layouts: auto`` leaves tp > 1 out for it."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import apply_activation_checkpointing, parallelize_model
from earl_lightning.parallel.plans import decoder_units, reject_unplanned_tp, tp_plan_error
from tests.distributed.test_any_decoder_layouts import FAMILIES, NO_PLAN, tiny_config

NO_PLAN_LINE = "model type gpt2 has no tensor-parallel plan (base_model_tp_plan); use tp=1 layouts"


def tiny(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type))


@pytest.mark.parametrize("model_type", [*FAMILIES, NO_PLAN])
def test_blocks_from_no_split_modules(model_type):
    model = tiny(model_type)
    units = decoder_units(model)
    assert len(units) == 2 and all(type(m).__name__ in model._no_split_modules for _, m in units)
    assert (tp_plan_error(model) is None) == (model_type != NO_PLAN)
    apply_activation_checkpointing(model, enabled=False)  # the same blocks, now wrapped
    assert [n for n, _ in decoder_units(model)] == [n for n, _ in units]
    assert all(hasattr(m, "_checkpoint_wrapped_module") for _, m in decoder_units(model))


def test_no_plan_refuses_tp_in_one_line():
    model = tiny(NO_PLAN)
    assert tp_plan_error(model) == NO_PLAN_LINE
    with pytest.raises(
        ValueError,
        match=r"^`layouts.rollout` has tp=2, but "
        + NO_PLAN_LINE.replace("(", r"\(").replace(")", r"\)")
        + "$",
    ):
        reject_unplanned_tp(model, Layout(dp=1, tp=2), arg="layouts.rollout")
    reject_unplanned_tp(model, Layout(dp=2, tp=1))
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        parallelize_model(model, mesh=None, layout=Layout(dp=1, tp=2))


def test_unsupported_style_is_named():
    model = tiny("llama")
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.mlp.experts": "local_colwise",
    }
    assert tp_plan_error(model) == (
        "model type llama: tensor-parallel style 'local_colwise' (for 'layers.*.mlp.experts') is not supported by "
        "EarlStrategy (supported: colwise, rowwise, colwise_rep, rowwise_rep, colwise_gather_output, "
        "rowwise_split_input, replicated_with_grad_allreduce); use tp=1 layouts"
    )


def test_strategy_refuses_tp_and_auto_leaves_it_out(monkeypatch):
    from earl_lightning.strategies.earl import EarlStrategy

    monkeypatch.setattr(EarlStrategy, "world_size", property(lambda self: 4))
    strategy = EarlStrategy(train_layout=Layout(dp=2, tp=2))
    strategy._resolve_layouts(4)
    with pytest.raises(
        ValueError, match=r"^`train_layout` has tp=2, but model type gpt2 has no tensor-parallel"
    ):
        strategy._check_heads(tiny(NO_PLAN), "policy")
    for model_type, tps in ((NO_PLAN, {1}), ("llama", {1, 2})):
        strategy = EarlStrategy(layouts="auto")
        strategy._resolve_layouts(4)
        strategy._check_heads(tiny(model_type), "policy")
        assert {c.tp for c in strategy.listed_layouts} == tps, model_type


def test_memory_model_reads_every_family():
    from earl_lightning.parallel.model_sizes import ModelSizes

    for model_type in (*FAMILIES, NO_PLAN):
        sizes = ModelSizes.from_config(tiny_config(model_type))
        assert (sizes.num_layers, sizes.hidden_size, sizes.num_heads) == (2, 64, 4), model_type
    # GPT-2: n_inner=None
    assert ModelSizes.from_config(tiny_config(NO_PLAN)).intermediate_size == 4 * 64

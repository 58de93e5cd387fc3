"""The train forward's MLP and RMSNorm elementwise work compiled by torch.compile
(``optim.fused_elementwise``, earl_lightning/train/fused.py): the functions it compiles must be
what Llama, Mistral, Qwen2 and Qwen3's modules compute; the train forward through the compiled
kernels must give the eager forward's log-probs and gradients to float rounding, and a PPO update
must end where the eager one does; it must not apply without gradients, when off, for small
calls, in bf16, or for a model that recomputes its layers; the modules' forwards must be restored
(the written-out norm's under it); where compiling fails, a warning and the eager forward."""

from __future__ import annotations

import copy
import importlib
import logging

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from earl_lightning.modules.config import OptimConfig
from earl_lightning.modules.views import update_view
from earl_lightning.train import fused
from earl_lightning.train import update as update_mod
from earl_lightning.train.forward import forward_micro_batch
from earl_lightning.train.rms_norm import rms_norm_backward
from earl_lightning.train.update import Models
from tests.unit.test_scored_last_layer import SMALL, _batch, _qwen
from tests.updates import sgd_update

NONE = {"swiglu": 0, "rms_norm": 0, "rope": 0}
MLPS = [
    (LlamaMLP, LlamaConfig),
    (MistralMLP, MistralConfig),
    (Qwen2MLP, Qwen2Config),
    (Qwen3MLP, Qwen3Config),
]


@pytest.fixture
def counted(monkeypatch):
    """Calls of the compiled kernels, counted; calls from 1,024 values take them (the tests'
    batches are small)."""
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 1024)
    kernels = fused.KERNELS.get(128, 32)
    assert kernels is not None, "torch.compile could not build the kernels on this machine"
    calls = {"swiglu": 0, "rms_norm": 0, "rope": 0}
    for name in calls:
        real = getattr(kernels, name)

        def count(*args, _name=name, _real=real):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(kernels, name, count)
    return calls


@pytest.mark.parametrize("mlp_cls,config_cls", MLPS)
def test_the_compiled_functions_are_what_the_modules_compute(mlp_cls, config_cls):
    assert mlp_cls.__name__ in fused.MLPS
    torch.manual_seed(0)
    mlp = mlp_cls(config_cls(**SMALL))
    assert type(mlp.act_fn).__name__ in fused.SILUS
    x = torch.randn(3, 7, SMALL["hidden_size"])
    ours = mlp.down_proj(fused.swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    assert torch.equal(ours, mlp(x))


@pytest.mark.parametrize("cls", [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm])
def test_the_norm_function_is_the_modules(cls):
    torch.manual_seed(0)
    norm = cls(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 17, 48) * 3
    torch.testing.assert_close(fused.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


@pytest.mark.parametrize("name", fused.ROPE_MODULES)
def test_the_rope_function_is_the_modeling_modules(name):
    module = importlib.import_module(name)
    original = getattr(module.apply_rotary_pos_emb, "__wrapped__", module.apply_rotary_pos_emb)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 16, generator=g).transpose(1, 2)
    k = torch.randn(2, 9, 2, 16, generator=g).transpose(1, 2)
    cos, sin = torch.randn(2, 2, 9, 16, generator=g)
    for a, b in zip(fused.rope(q, k, cos, sin), original(q, k, cos, sin)):
        assert torch.equal(a, b)


def test_the_rope_dispatcher_hands_calls_outside_a_block_to_the_original(counted):
    from transformers.models.qwen2 import modeling_qwen2

    model = _qwen()
    with fused.fused_elementwise(model):
        pass
    dispatcher = modeling_qwen2.apply_rotary_pos_emb
    assert dispatcher.earl_dispatcher
    q = torch.randn(2, 4, 300, 32, requires_grad=True)  # 76,800 values: would qualify
    cos, sin = torch.randn(2, 2, 300, 32)
    out = dispatcher(q, q[:, :2], cos, sin)
    assert counted["rope"] == 0
    for a, b in zip(out, dispatcher.__wrapped__(q, q[:, :2], cos, sin)):
        assert torch.equal(a, b)


def test_a_model_compiled_whole_traces_transformers_rope(counted, monkeypatch):
    """Inside torch.compile's tracing of a whole model the dispatcher hands the call on, so the
    trace holds transformers' formula, not a context variable's read."""
    model, mb = _qwen(), _batch()
    _pass(model, mb, True)
    assert counted["rope"] >= 1
    counted["rope"] = 0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _pass(model, mb, True)
    assert counted["rope"] == 0 and counted["swiglu"] >= 1


def _pass(model, mb, on: bool):
    model.zero_grad(set_to_none=True)
    res = forward_micro_batch(model, mb, temperature=1.0, scored=True, fused=on)
    (res["logprobs"] * mb.tokens["action_mask"]).sum().backward()
    return res["logprobs"].detach(), [p.grad.clone() for p in model.parameters()]


def test_train_forward_through_the_kernels_matches_the_eager_one(counted):
    model, mb = _qwen(), _batch()
    lp_eager, g_eager = _pass(model, mb, False)
    assert counted == NONE
    lp, g = _pass(model, mb, True)
    # both layers' MLPs; the norms of the full-length layer (the scored last layer's are smaller)
    assert counted["swiglu"] >= 1 and counted["rms_norm"] >= 2 and counted["rope"] >= 1
    torch.testing.assert_close(lp, lp_eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_eager):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)


def test_not_taken_without_gradients_when_off_small_or_bf16(counted, monkeypatch):
    model, mb = _qwen(), _batch()
    with torch.no_grad():
        forward_micro_batch(model, mb, temperature=1.0)
    _pass(model, mb, False)
    assert counted == NONE
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 1 << 30)
    _pass(model, mb, True)
    assert counted == NONE
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 1024)
    _pass(model.to(torch.bfloat16), mb, True)
    assert counted == NONE


def test_a_forward_without_a_qualifying_call_compiles_nothing(monkeypatch):
    """The compile is paid at the first call that takes a kernel: small runs (the tests', a
    quick start's) never pay it."""
    monkeypatch.setattr(fused, "KERNELS", fused._Kernels())
    model, mb = _qwen(), _batch()  # 6 rows of about 40 tokens: far below a million values
    _pass(model, mb, True)
    assert not fused.KERNELS.tried
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 1024)
    _pass(model, mb, True)
    assert fused.KERNELS.tried and fused.KERNELS.swiglu is not None


def test_the_modules_are_restored_and_the_written_out_norm_runs_below_the_threshold(counted):
    model = _qwen()
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    with rms_norm_backward(model):
        written_out = [m.forward for m in norms]
        with fused.fused_elementwise(model):
            assert all(m.forward is not w for m, w in zip(norms, written_out))
            x = torch.randn(1, 2, 128, requires_grad=True)  # 256 values: below the threshold
            assert type(norms[0](x).grad_fn).__name__ == "_RMSNormBackward"
            assert counted["rms_norm"] == 0
        assert [m.forward for m in norms] == written_out
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(RuntimeError, match="inside"):
        with fused.fused_elementwise(model):
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_model_that_recomputes_its_layers_is_left_alone(counted):
    from earl_lightning.parallel.parallelize import apply_activation_checkpointing

    model, mb = _qwen(), _batch()
    apply_activation_checkpointing(model, enabled=True)
    with fused.fused_elementwise(model):
        assert not any("forward" in vars(m) for m in model.modules())
    _pass(model, mb, True)  # no CheckpointError
    assert counted == NONE


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "earl_lightning" and r.levelno == logging.WARNING
    ]


def test_a_failed_compile_warns_and_runs_eagerly(monkeypatch, caplog):
    monkeypatch.setattr(fused, "KERNELS", fused._Kernels())
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 1024)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused.torch, "compile", no_compiler)
    model, mb = _qwen(), _batch()
    lp_eager, g_eager = _pass(model, mb, False)
    with caplog.at_level(logging.INFO, logger="earl_lightning"):
        lp, g = _pass(model, mb, True)
        (said,) = _warnings(caplog)
        assert said.startswith("optim.fused_elementwise: torch.compile could not build")
        assert "RuntimeError: no C++ compiler" in said and "fused_elementwise: false" in said
        assert torch.equal(lp, lp_eager)
        assert all(torch.equal(a, b) for a, b in zip(g, g_eager))
        _pass(model, mb, True)
        assert len(_warnings(caplog)) == 1  # tried once per process


def test_ppo_update_through_the_kernels_ends_where_the_eager_one_does(counted):
    base, mb = _qwen(), _batch()
    with torch.no_grad():  # stale old log-probs, so the ratios are not 1 and clipping acts
        mb.tokens["old_logprobs"] = forward_micro_batch(base, mb, temperature=1.0)["logprobs"] + 0.3
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    sa = sgd_update(a, mb, fused_elementwise=False)
    assert counted == NONE
    sb = sgd_update(b, mb, fused_elementwise=True)
    assert counted["swiglu"] and counted["rms_norm"]
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)


def test_the_setting_reaches_the_train_forward(monkeypatch):
    assert OptimConfig().fused_elementwise
    seen = []

    class Seen(Exception):
        pass

    def spy(*args, **kwargs):
        seen.append(kwargs["fused"])
        raise Seen

    monkeypatch.setattr(update_mod, "forward_micro_batch", spy)
    model, mb = _qwen(), _batch()
    for on in (True, False):
        cfg = update_view(optim=OptimConfig(fused_elementwise=on))
        with pytest.raises(Seen):
            update_mod.micro_batch_loss(Models(model), mb, cfg, {"tokens": 1.0, "seqs": 1.0})
    assert seen == [True, False]

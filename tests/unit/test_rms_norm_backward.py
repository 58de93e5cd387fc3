"""The RMSNorm with its backward written out (``optim.rms_norm_backward``,
earl_lightning/train/rms_norm.py): for Llama, Mistral, Qwen2 and Qwen3's RMSNorm modules the
forward must be the module's bit for bit and the gradients autograd's to float rounding; it must not
apply where the module's own dtype handling matters (bf16), where nothing is recorded, or when
turned off; a PPO update through it must end where autograd's does; the modules are restored after
the block, also after an error."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from earl_lightning.modules.config import OptimConfig
from earl_lightning.modules.views import update_view
from earl_lightning.train import rms_norm as rn
from earl_lightning.train import update as update_mod
from earl_lightning.train.forward import forward_micro_batch
from earl_lightning.train.update import Models
from tests.unit.test_scored_last_layer import SMALL, _batch, _qwen
from tests.updates import sgd_update


@pytest.mark.parametrize("cls", [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm])
def test_forward_is_the_modules_bit_for_bit_and_gradients_are_autograds(cls):
    assert cls.__name__ in rn.RMS_NORMS
    torch.manual_seed(0)
    norm = cls(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 17, 48) * 3
    grad = torch.randn(3, 17, 48)

    def run(written_out):
        norm.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = rn.rms_norm(norm, leaf) if written_out else norm(leaf)
        out.backward(grad)
        return out.detach(), leaf.grad, norm.weight.grad

    ours, theirs = run(True), run(False)
    assert torch.equal(ours[0], theirs[0])
    for a, b in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_not_taken_in_bf16_without_gradients_or_when_off():
    norm = Qwen2RMSNorm(16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    assert type(rn.rms_norm(norm, x).grad_fn).__name__ == "_RMSNormBackward"
    with torch.no_grad():
        assert rn.rms_norm(norm, x).grad_fn is None
    bf = Qwen2RMSNorm(16).to(torch.bfloat16)
    xb = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    assert torch.equal(rn.rms_norm(bf, xb), bf(xb))
    assert type(rn.rms_norm(bf, xb).grad_fn).__name__ != "_RMSNormBackward"
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with rn.rms_norm_backward(model, enabled=False):
        assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad(), rn.rms_norm_backward(model):  # nothing recorded: nothing to write out
        assert not any("forward" in vars(m) for m in model.modules())


def test_the_block_puts_it_on_every_norm_and_takes_it_off_again():
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16))  # q_norm and k_norm too
    norms = [m for m in model.modules() if isinstance(m, Qwen3RMSNorm)]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q, k; the final norm
    with rn.rms_norm_backward(model):
        assert all("forward" in vars(m) for m in norms)
    assert not any("forward" in vars(m) for m in norms)
    with pytest.raises(RuntimeError, match="inside"):
        with rn.rms_norm_backward(model):
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in norms)


def test_ppo_update_through_it_ends_where_autograds_does(monkeypatch):
    base, mb = _qwen(), _batch()
    with torch.no_grad():  # stale old log-probs, so the ratios are not 1 and clipping acts
        mb.tokens["old_logprobs"] = forward_micro_batch(base, mb, temperature=1.0)["logprobs"] + 0.3
    calls, real = [], rn._RMSNorm.apply
    monkeypatch.setattr(rn._RMSNorm, "apply", lambda *a: calls.append(1) or real(*a))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    sa = sgd_update(a, mb, rms_norm_backward=False)
    assert not calls
    sb = sgd_update(b, mb, rms_norm_backward=True)
    assert calls  # every norm of every micro-batch's forward
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)


def test_the_settings_reach_the_train_forward(monkeypatch):
    """``optim.causal_chunks`` and ``optim.rms_norm_backward`` (both on by default) are what the
    update's forward is called with."""
    assert OptimConfig().rms_norm_backward and OptimConfig().causal_chunks
    seen = []

    class Seen(Exception):
        pass

    def spy(*args, **kwargs):
        seen.append((kwargs["chunked"], kwargs["norm_backward"]))
        raise Seen

    monkeypatch.setattr(update_mod, "forward_micro_batch", spy)
    model, mb = _qwen(), _batch()
    for chunks, norms in ((True, True), (False, False), (True, False)):
        seen.clear()
        cfg = update_view(optim=OptimConfig(causal_chunks=chunks, rms_norm_backward=norms))
        with pytest.raises(Seen):
            update_mod.micro_batch_loss(Models(model), mb, cfg, {"tokens": 1.0, "seqs": 1.0})
        assert seen == [(chunks, norms)]


def test_a_model_that_recomputes_its_layers_keeps_autograds_norms():
    """Activation checkpointing reruns a layer's forward in the backward, after the block: the
    written-out norm would have saved other tensors than the rerun (torch raises on that)."""
    from earl_lightning.parallel.parallelize import apply_activation_checkpointing

    model, mb = _qwen(), _batch()
    apply_activation_checkpointing(model, enabled=True)
    with rn.rms_norm_backward(model):
        assert not any(
            "forward" in vars(m) for m in model.modules() if "RMSNorm" in type(m).__name__
        )
    res = forward_micro_batch(model, mb, temperature=1.0)
    (res["logprobs"] * mb.tokens["action_mask"]).sum().backward()  # no CheckpointError
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

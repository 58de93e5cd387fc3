"""Activation checkpointing that a run switches per step: the wrapped layers compute the same
gradients with recomputation on or off (and as the unwrapped model), keep the plain state-dict
names, really drop the layers' saved activations when on, and AdaptiveParallelism can choose it
for the train stage (here after an out-of-memory error without it) with the same parameters as a
run that never checkpointed."""

from __future__ import annotations

import copy

import pytest
import torch

import earl_lightning.modules.rl as rl
from earl_lightning.callbacks import AdaptiveParallelism
from earl_lightning.models import load_model
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import (
    SwitchableCheckpointWrapper,
    is_checkpoint_switchable,
    parallelize_model,
    set_activation_checkpointing,
)
from earl_lightning.profiling.profiler import ProfileGrid, profile_stages
from earl_lightning.strategies import EarlStrategy
from tests.unit.test_adaptive import datamodule, module, tiny_path, trainer
from tests.unit.test_adaptive_oom import CPU_OOM


def _loss_and_saved_bytes(model, ids):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), sum(saved)


def test_switchable_wrapper_same_gradients_and_names_less_saved_memory():
    torch.manual_seed(0)
    plain = load_model(tiny_path())
    wrapped = parallelize_model(
        copy.deepcopy(plain), mesh=None, layout=Layout(), checkpoint_switchable=True
    )
    assert is_checkpoint_switchable(wrapped) and not is_checkpoint_switchable(plain)
    assert all(isinstance(layer, SwitchableCheckpointWrapper) for layer in wrapped.model.layers)
    # checkpoints stay interchangeable
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, plain.config.vocab_size, (2, 96))
    ref_loss, ref_saved = _loss_and_saved_bytes(plain, ids)
    ref_grads = [p.grad.clone() for p in plain.parameters()]
    saved = {}
    for on in (False, True):
        set_activation_checkpointing(wrapped, on)
        wrapped.zero_grad(set_to_none=True)
        loss, saved[on] = _loss_and_saved_bytes(wrapped, ids)
        assert torch.equal(loss, ref_loss)
        for g, r in zip((p.grad for p in wrapped.parameters()), ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    assert saved[False] == ref_saved
    assert saved[True] < 0.5 * saved[False]  # the layers' activations are recomputed, not kept


def test_set_checkpointing_on_an_unwrapped_model_is_an_error():
    with pytest.raises(ValueError, match="not wrapped for activation checkpointing"):
        set_activation_checkpointing(load_model(tiny_path()), True)


def test_argument_error():
    with pytest.raises(
        ValueError,
        match=r"`activation_checkpointing` must be a non-empty list of booleans such as "
        r"\[False, True\], got 'yes'",
    ):
        AdaptiveParallelism(activation_checkpointing="yes")


def test_selector_asking_for_checkpointing_the_model_cannot_switch_is_an_error(tmp_path):
    class AlwaysCheckpoint:
        def select(self, stage, stats, current):
            return Layout(activation_checkpointing=stage == "train")

    class Register(__import__("lightning").Callback):
        def setup(self, trainer, pl_module, stage):
            trainer.strategy.register_selector(AlwaysCheckpoint())

    with pytest.raises(
        ValueError,
        match=r"stage 'train' asks for activation_checkpointing=True, but `policy` was "
        r"sharded with activation_checkpointing=False and cannot switch",
    ):
        trainer(tmp_path, [Register()], steps=1).fit(module(), datamodule())


def _params(mod):
    return {k: v.detach().clone() for k, v in mod.policy.state_dict().items()}


def _plain_module():
    # Wrapped layers run the plain forward and autograd's norms (train/scored.py and
    # train/rms_norm.py decline them); the reference does too, so the two runs differ by
    # checkpointing alone and not by the products' float rounding.
    optim = dict(micro_batch_tokens=1024, on_policy_shortcut=False, scored_last_layer=False)
    return module(optim={**optim, "rms_norm_backward": False, "causal_chunks": False})


def test_adaptive_switches_to_checkpointing_after_an_oom_with_the_same_parameters(
    tmp_path, monkeypatch
):
    ref_mod = _plain_module()
    trainer(tmp_path / "ref", [AdaptiveParallelism(micro_batch_tokens=[1024])], steps=2).fit(
        ref_mod, datamodule()
    )

    real, seen = rl.ppo_update, []

    def update(*args, **kw):  # without recomputation the train stage "runs out of memory"
        layers = list(strategy.lightning_module.policy.model.layers)
        on = all(isinstance(la, SwitchableCheckpointWrapper) and la.enabled for la in layers)
        seen.append(on)
        if not on:
            raise CPU_OOM
        return real(*args, **kw)

    monkeypatch.setattr(rl, "ppo_update", update)
    strategy = EarlStrategy()
    cb = AdaptiveParallelism(micro_batch_tokens=[1024], activation_checkpointing=[False, True])
    mod = _plain_module()
    trainer(tmp_path / "ckpt", [cb], steps=2, strategy=strategy).fit(mod, datamodule())
    assert strategy.checkpoint_switchable
    assert seen == [False, True, True]  # one OOM, then the checkpointed layout, kept at step 2
    assert [(o["stage"], o["layout"]) for o in cb.oom_events] == [("train", "dp1xtp1-mbt1024")]
    assert [h["layout"] for h in cb.history if h["stage"] == "train"][-2:] == [
        "dp1xtp1-mbt1024-ckpt"
    ] * 2
    got, ref = _params(mod), _params(ref_mod)
    assert list(got) == list(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_profiler_measures_checkpointing_for_the_train_stage_only():
    grid = ProfileGrid(contexts=[64], num_seqs=[2], gen_len=1, repeats=1)
    path = tiny_path()
    from earl_lightning.models import load_tokenizer

    run = profile_stages(
        lambda: load_model(path),
        load_tokenizer(path),
        layouts=[Layout(), Layout(activation_checkpointing=True)],
        grid=grid,
    )
    assert run.measured == 4
    assert run.table.layouts("train") == ["dp1xtp1", "dp1xtp1-ckpt"]
    assert run.table.layouts("rollout") == run.table.layouts("experience") == ["dp1xtp1"]

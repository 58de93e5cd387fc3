"""LoRA on one process: the `--model.peft` errors, the adapted model's trainable parameters, the
base model behind disabled adapters, the merged weights, checkpointing and the replica's copy.
Sharded: tests/distributed/test_lora_layouts.py; whole runs: tests/e2e/test_lora.py."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.core.config_groups import coerce
from earl_lightning.models import load_model
from earl_lightning.models.lora import (
    LoraSettings,
    adapters_disabled,
    apply_lora,
    merge_plan,
    merged_tensors,
)
from earl_lightning.modules.rl import AgenticRLModule
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import build_replica, parallelize_model, reject_lora_tp
from earl_lightning.rollout.weight_sync import stream_full_weights

IDS = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30], [8, 2, 40, 41, 6, 19, 12, 4]])


def adapted(seed: int = 0, **settings) -> torch.nn.Module:
    """earl-tiny with adapters whose B is not zero (a freshly made adapter is the identity)."""
    torch.manual_seed(seed)  # lora_A's initialisation draws from the global generator
    model = apply_lora(load_model("earl-tiny"), LoraSettings(**settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"r": 0}, r"`--model.peft.r` must be a positive integer \(the adapters' rank\), got 0"),
        ({"r": 2.5}, r"`--model.peft.r` must be a positive integer .*got 2.5"),
        ({"alpha": 0}, r"`--model.peft.alpha` must be a positive number, got 0"),
        ({"dropout": 1.0}, r"`--model.peft.dropout` must be a number in \[0, 1\), got 1.0"),
        (
            {"target_modules": []},
            r"`--model.peft.target_modules` must be 'all-linear', a non-empty list of module "
            r"names or a regular expression, got \[\]",
        ),
        (
            {"kwargs": {"use_dora": True}},
            r"`--model.peft.kwargs` sets \['use_dora'\], which is not supported; "
            r"supported: \['use_rslora'",
        ),
        (
            {"kwargs": {"init_lora_weights": "pissa"}},
            r"`--model.peft.kwargs.init_lora_weights` must be true, false "
            r"or 'gaussian', got 'pissa'",
        ),
        (
            {"kwargs": {"layers_pattern": "layers"}},
            r"`--model.peft`: peft rejects these settings: .*layers_pattern",
        ),
    ],
)
def test_settings_errors_name_the_argument_and_the_value(settings, match):
    with pytest.raises(ValueError, match=match):
        LoraSettings(**settings)


def test_unknown_setting_and_a_target_that_matches_nothing():
    with pytest.raises(
        ValueError, match=r"`--model.peft` has unknown settings \['rank'\]; valid: \['r', "
    ):
        AgenticRLModule(peft={"rank": 4})
    with pytest.raises(
        ValueError,
        match=r"^`--model.peft.target_modules` \['qkv'\] matches no module of "
        r"Qwen2ForCausalLM; its linear layers are named down_proj, gate_proj, k_proj, o_proj, "
        r"q_proj, up_proj, v_proj \(a list of these, a regular expression over module paths, or "
        r"'all-linear'\)$",
    ):
        apply_lora(load_model("earl-tiny"), LoraSettings(target_modules=["qkv"]))
    with pytest.raises(
        ValueError,
        match=r"selects 'model.embed_tokens' \(Embedding\); LoRA here covers linear "
        r"layers only",
    ):
        apply_lora(load_model("earl-tiny"), LoraSettings(target_modules=["embed_tokens", "q_proj"]))


def test_tensor_parallel_with_lora_is_refused_in_one_line():
    model = adapted()
    with pytest.raises(
        ValueError,
        match=r"`layouts.rollout` has tp=2, but the model carries LoRA adapters "
        r"\(--model.peft\), which EarlStrategy does not shard with tensor "
        r"parallel; use tp=1 layouts",
    ):
        reject_lora_tp(model, Layout(dp=1, tp=2), arg="layouts.rollout")
    reject_lora_tp(model, Layout(dp=2, tp=1))
    reject_lora_tp(load_model("earl-tiny"), Layout(dp=1, tp=2))


def test_only_the_adapters_train_and_the_module_loads_no_reference_copy():
    module = AgenticRLModule(
        peft={"r": 4, "target_modules": ["q_proj", "v_proj"]}, algorithm={"kl": {"coef": 0.1}}
    )
    module.configure_model()
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    assert module.ref_policy is None and module.hparams.peft["r"] == 4
    assert not module.workload.reference_model


def test_disabled_adapters_are_the_base_model_and_freeze_nothing():
    model, base = adapted(), load_model("earl-tiny").eval()
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        adapted_logits = model(IDS).logits
        with adapters_disabled(model) as off:
            torch.testing.assert_close(off(IDS).logits, base(IDS).logits, rtol=0, atol=0)
        torch.testing.assert_close(model(IDS).logits, adapted_logits, rtol=0, atol=0)
    assert (adapted_logits - base(IDS).logits).abs().max() > 1e-3
    assert grads == {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kwargs", [{}, {"use_rslora": True}])
def test_merged_weights_are_a_plain_model_with_the_adapted_outputs(kwargs):
    model = adapted(r=4, alpha=8.0, kwargs=kwargs)
    # small buckets split the layers' pieces
    merged = dict(stream_full_weights(model, bucket_bytes=4096))
    plain = load_model("earl-tiny").eval()
    assert set(merged) == set(dict(plain.named_parameters()))
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, model(IDS).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(
        ValueError, match=r"LoRA layers \['model.layers.0.mlp.up_proj'\] lack some of"
    ):
        pieces = [
            (n, p)
            for n, p in model.named_parameters()
            if n != "model.layers.0.mlp.up_proj.lora_B.default.weight"
        ]
        list(merged_tensors(pieces, merge_plan(model)))


def test_activation_checkpointing_keeps_the_adapters_gradients():
    grads = []
    for checkpointing in (False, True):
        model = adapted().train()
        parallelize_model(
            model, mesh=None, layout=Layout(dp=1, tp=1, activation_checkpointing=checkpointing)
        )
        model(IDS).logits.float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == {n.replace("_checkpoint_wrapped_module.", "") for n in grads[1]}
    for name, g in grads[1].items():
        torch.testing.assert_close(g, grads[0][name.replace("_checkpoint_wrapped_module.", "")])


def test_a_replica_carries_the_same_adapters():
    model = adapted()
    replica = build_replica(model, mesh=None, layout=Layout(dp=1, tp=1), device="cpu")
    assert [n for n, _ in replica.named_parameters()] == [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for (_, dst), (_, src) in zip(replica.named_parameters(), model.named_parameters()):
            dst.copy_(src)
        torch.testing.assert_close(replica(IDS).logits, model(IDS).logits, rtol=0, atol=0)


def test_settings_round_trip_through_hyperparameters():
    s = LoraSettings(r=4, target_modules=["q_proj"], kwargs={"use_rslora": True})
    module = AgenticRLModule(peft=s)
    assert coerce(LoraSettings, module.hparams.peft, "--model.peft") == s
    assert AgenticRLModule().hparams.peft is None


def test_earl_strategy_refuses_tensor_parallel_layouts_with_lora_at_setup(monkeypatch):
    from earl_lightning.strategies import EarlStrategy

    strategy = EarlStrategy(
        train_layout={"dp": 2, "tp": 1}, layouts={"rollout": {"dp": 1, "tp": 2}}
    )
    with pytest.raises(
        ValueError, match=r"^`layouts.rollout` has tp=2, but the model carries LoRA adapters"
    ):
        strategy._check_heads(adapted(), "policy")  # what setup runs for each model before sharding
    auto = EarlStrategy(layouts="auto")
    auto._train = Layout(dp=2, tp=1)
    monkeypatch.setattr(EarlStrategy, "world_size", property(lambda self: 2))
    auto._check_heads(adapted(), "policy")
    assert [(c.dp, c.tp) for c in auto.candidate_layouts] == [(2, 1)]  # tp=2 left out, not refused

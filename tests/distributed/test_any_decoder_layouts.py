"""Any decoder-only architecture under every layout: tiny random models of several transformers
families (their own ``_no_split_modules`` and ``base_model_tp_plan``) take one PPO-clip update at
dp=2, tp=2 (2 processes) and dp=2 x tp=2 (4 processes), equal to the one-process reference.
A model without a tensor-parallel plan is refused tp > 1 in one line and still trains data-parallel.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_invariance_layouts import _worker, reference_update

pytestmark = pytest.mark.distributed

# Two layers, 4 heads / 2 KV heads (GQA; tp=2 divides both), vocab 128 (fixed_batch draws ids < 100).
_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=16),  # per-head q_norm / k_norm: 'replicated_with_grad_allreduce'
    "mistral": dict(sliding_window=None),
    "gemma": dict(head_dim=16),  # tied embeddings scaled by sqrt(hidden)
    "phi3": dict(pad_token_id=0),  # fused qkv_proj / gate_up_proj: 'colwise_gather_output'
}
NO_PLAN = "gpt2"  # no base_model_tp_plan: data parallel only


def tiny_config(model_type: str):
    from transformers import AutoConfig

    if model_type == NO_PLAN:
        return AutoConfig.for_model(
            "gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64
        )
    return AutoConfig.for_model(model_type, **_COMMON, **FAMILIES[model_type])


def tiny_family(model_type: str, root) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = root / model_type
    AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(path)
    return str(path)


def _check_family(ref, results, model_type: str) -> None:
    ref_loss, ref_params = ref
    for (dp, tp, ckpt), (loss, params) in results[0].items():
        where = f"{model_type} dp={dp} tp={tp} ckpt={ckpt}"
        assert loss == pytest.approx(ref_loss, rel=1e-4), where
        assert params.keys() == ref_params.keys(), where
        for name, value in params.items():
            torch.testing.assert_close(
                torch.from_numpy(value),
                ref_params[name],
                rtol=1e-4,
                atol=1e-6,
                msg=f"{name} {where}",
            )


def _family_worker(rank: int, world: int, runs: dict[str, tuple[str, list]]):
    return {t: _worker(rank, world, path, layouts) for t, (path, layouts) in runs.items()}


def _run(tmp_path, world: int, layouts: dict[str, list]) -> None:
    runs = {t: (tiny_family(t, tmp_path), lay) for t, lay in layouts.items()}
    results = run_distributed(_family_worker, world, runs)
    for t, (path, _) in runs.items():
        _check_family(reference_update(path), [r[t] for r in results], t)


def test_families_on_2_processes(tmp_path):
    """dp=2 with activation checkpointing on the `_no_split_modules` blocks; tp=2 from the model's
    plan; the model without a plan at dp=2 only."""
    _run(
        tmp_path,
        2,
        {**{t: [(2, 1, True), (1, 2, False)] for t in FAMILIES}, NO_PLAN: [(2, 1, True)]},
    )


def test_families_on_4_processes(tmp_path):
    _run(tmp_path, 4, {t: [(2, 2, False)] for t in FAMILIES})


def _reshard_worker(rank: int, world: int, paths: dict[str, str]):
    from tests.distributed.test_reshard import _worker as reshard_worker

    return {t: reshard_worker(rank, world, p, (2, 1), [(1, 2)]) for t, p in paths.items()}


def test_layout_reshard_of_planned_families(tmp_path):
    """The layout-aware reshard (dp=2 train copy -> tp=2 replica and back) equals the naive one on
    the plans that place parameters unlike Llama's: Qwen3's replicated per-head norms, Phi-3's fused projections."""
    from tests.distributed.test_reshard import _check as check_reshard

    paths = {t: tiny_family(t, tmp_path) for t in ("qwen3", "phi3")}
    results = run_distributed(_reshard_worker, 2, paths)
    for t in paths:
        check_reshard([r[t] for r in results])

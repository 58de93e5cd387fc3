"""LoRA on 2 gloo processes equals one process: a PPO-clip update of the adapters on a fixed batch
under dp=2 FSDP2 (with and without activation checkpointing), the whole replica the rollout and
experience stages run (adapters on: the policy; off: the base model, the KL reference), and the
merged weights a generation engine receives (gathered from the shards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from earl_lightning.models.lora import LoraSettings, adapters_disabled, apply_lora
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import build_replica, parallelize_model
from earl_lightning.parallel.reshard import reshard_naive
from earl_lightning.rollout.weight_sync import stream_full_weights
from tests.distributed.launch import run_distributed
from tests.distributed.test_invariance_layouts import LR, B, fixed_batch, ppo_clip_sum, tiny_path

pytestmark = pytest.mark.distributed


def adapted(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # lora_A's initialisation
    return apply_lora(
        AutoModelForCausalLM.from_pretrained(path), LoraSettings(r=4, alpha=8.0, dropout=0.0)
    )


def update(model: torch.nn.Module, rows: slice) -> float:
    batch = fixed_batch()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loss = ppo_clip_sum(model, batch, rows) / batch["mask"].sum()
    loss.backward()
    opt.step()
    return loss.item()


def logits(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(adapted, adapters off) logits of the fixed batch's tokens."""
    ids = fixed_batch()["ids"]
    with torch.no_grad():
        on = model(ids).logits
        with adapters_disabled(model) as base:
            off = base(ids).logits
    return on, off


def reference(path: str) -> dict:
    model = adapted(path)
    loss = update(model, slice(None))
    on, off = logits(model.eval())
    return {"loss": loss, "on": on, "off": off, "merged": dict(stream_full_weights(model))}


def _worker(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    for ckpt in (False, True):
        model = adapted(path)
        parallelize_model(
            model, mesh=mesh, layout=Layout(dp=2, tp=1, activation_checkpointing=ckpt)
        )
        total = torch.tensor(update(model, slice(rank * B // 2, (rank + 1) * B // 2)))
        dist.all_reduce(total)
        merged = {n: t.numpy() for n, t in stream_full_weights(model)}  # every rank: a collective
        replica = build_replica(model, mesh=mesh, layout=Layout(dp=2, tp=1), device="cpu")
        reshard_naive(model, replica)
        on, off = logits(replica)
        out[ckpt] = {"loss": total.item(), "on": on.numpy(), "off": off.numpy(), "merged": merged}
    return out


def test_lora_update_replica_and_merged_weights_equal_one_process():
    path = tiny_path()
    ref = reference(path)
    results = run_distributed(_worker, 2, path)
    for rank, by_ckpt in enumerate(results):
        for ckpt, got in by_ckpt.items():
            where = f"rank {rank}, activation_checkpointing={ckpt}"
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), where
            torch.testing.assert_close(
                torch.from_numpy(got["on"]), ref["on"], rtol=1e-4, atol=1e-5, msg=where
            )
            torch.testing.assert_close(
                torch.from_numpy(got["off"]), ref["off"], rtol=1e-4, atol=1e-5, msg=where
            )
            assert got["merged"].keys() == ref["merged"].keys(), where
            for name, value in got["merged"].items():
                torch.testing.assert_close(
                    torch.from_numpy(value),
                    ref["merged"][name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=f"{name}: {where}",
                )
    assert (ref["on"] - ref["off"]).abs().max() > 1e-4, "the update must move the adapters"

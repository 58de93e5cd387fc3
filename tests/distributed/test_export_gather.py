"""The end-of-fit export of a sharded policy on 2 gloo processes: FSDP2 (dp 2), tensor parallel
(tp 2) and activation-checkpointed layers all gather to the one-process model's tensors under its
own names, and the directory rank 0 writes loads back to the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from earl_lightning.parallel.layout import Layout
from tests.distributed.launch import run_distributed


def _gather_and_write(
    rank: int, world: int, dp: int, tp: int, checkpointing: bool, out: str
) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from earl_lightning.checkpoints.export import gather_state_dict, write_pretrained
    from earl_lightning.models import load_model, load_tokenizer
    from earl_lightning.parallel.parallelize import parallelize_model

    model = load_model("earl-tiny")
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layout = Layout(dp=dp, tp=tp, activation_checkpointing=checkpointing)
    parallelize_model(
        model, mesh=init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")), layout=layout
    )
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    state = gather_state_dict(model, keep=rank == 0)
    if rank == 0:
        write_pretrained(model, load_tokenizer("earl-tiny"), out, state)
    dist.barrier()
    if rank != 0:
        return {"sharded": sharded, "none": state is None}
    saved = load_file(f"{out}/model.safetensors")
    return {
        "sharded": sharded,
        "names": sorted(state) == sorted(reference),
        "equal": all(torch.equal(state[k], v) for k, v in reference.items()),
        "saved_equal": all(torch.equal(saved[k], reference[k]) for k in saved),
        "saved_names": len(saved) == len(reference) - 1,
    }  # the tied head once


@pytest.mark.parametrize(
    "dp, tp, checkpointing", [(2, 1, False), (1, 2, True)], ids=["fsdp_dp2", "tp2_checkpointed"]
)
def test_sharded_policy_gathers_to_the_one_process_model(tmp_path, dp, tp, checkpointing):
    ranks = run_distributed(_gather_and_write, 2, dp, tp, checkpointing, str(tmp_path / "hf_model"))
    assert ranks[0]["sharded"] and ranks[1]["sharded"] and ranks[1]["none"]
    assert ranks[0]["names"] and ranks[0]["equal"], (
        "gathered tensors differ from the one-process model"
    )
    assert ranks[0]["saved_equal"] and ranks[0]["saved_names"]

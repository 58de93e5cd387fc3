"""Invariance: one PPO-clip update on a fixed batch is the same under every layout.

Single process (the reference, computed here) vs dp=2, tp=2 (2 processes) and dp=2 x tp=2
(4 processes). Every rank normalizes its loss by the GLOBAL token count; FSDP sums dp gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from earl_lightning.models import make_tiny_model
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import parallelize_model
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed

B, T, CLIP, LR = 8, 12, 0.2, 0.5


def tiny_path() -> str:
    return str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128))


def fixed_batch() -> dict[str, torch.Tensor]:
    """Tokens, action mask (a prompt, then generated tokens of varying length), advantages and
    behaviour log-probs that differ from the model's so that some ratios clip."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 100, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for i in range(B):
        mask[i, 4 : 6 + i % 6] = 1.0
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
    noise = 0.3 * torch.randn(B, T, generator=g)
    return dict(ids=ids, mask=mask, adv=adv, noise=noise)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), logp], 1)  # [B, T]: log p(ids[t] | ids[<t])


def ppo_clip_sum(model, batch: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
    """Sum over the rows' generated tokens of the PPO-clip surrogate (token-mean needs / N_global)."""
    ids, mask, adv = batch["ids"][rows], batch["mask"][rows], batch["adv"][rows]
    logp = token_logprobs(model, ids)
    old = logp.detach() + batch["noise"][rows]
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    return -(surrogate * mask).sum()


def reference_update(path: str) -> tuple[float, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    batch = fixed_batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = ppo_clip_sum(model, batch, slice(None)) / batch["mask"].sum()
    loss.backward()
    opt.step()
    return loss.item(), {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_update(path: str, layout: Layout) -> tuple[float, dict[str, torch.Tensor]]:
    """The same update with `layout`; returns the global loss and the full updated parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    parallelize_model(model, mesh=mesh, layout=layout)
    batch = fixed_batch()
    dp_rank, _ = layout.coords(dist.get_rank())
    per = B // layout.dp  # ranks of one TP group take the same rows
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = (
        ppo_clip_sum(model, batch, slice(dp_rank * per, (dp_rank + 1) * per)) / batch["mask"].sum()
    )
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
    params = {
        n.replace("_checkpoint_wrapped_module.", ""): full(p).detach().clone()
        for n, p in model.named_parameters()
    }
    return total.item() / layout.tp, params


def _worker(rank: int, world: int, path: str, layouts: list[tuple[int, int, bool]]):
    out = {}
    for dp, tp, ckpt in layouts:
        loss, params = sharded_update(path, Layout(dp=dp, tp=tp, activation_checkpointing=ckpt))
        # numpy pickles by value; torch tensors would travel as shared memory of an exiting process
        out[(dp, tp, ckpt)] = (
            loss,
            {n: p.numpy() for n, p in params.items()} if rank == 0 else None,
        )
    return out


def _check(reference, results) -> None:
    ref_loss, ref_params = reference
    for (dp, tp, ckpt), (loss, params) in results[0].items():
        assert loss == pytest.approx(ref_loss, rel=1e-4), f"dp={dp} tp={tp} ckpt={ckpt}"
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(
                torch.from_numpy(value),
                ref_params[name],
                rtol=1e-4,
                atol=1e-6,
                msg=f"{name} dp={dp} tp={tp} ckpt={ckpt}",
            )
        moved = sum(
            (torch.from_numpy(params[n]) - p0).abs().sum().item()
            for n, p0 in initial_params().items()
        )
        assert moved > 0, "the update must change the parameters"


def initial_params() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {
        n: p.detach()
        for n, p in AutoModelForCausalLM.from_pretrained(tiny_path()).named_parameters()
    }


def test_update_invariant_on_2_processes():
    """Also with activation checkpointing (recomputation replays FSDP's all-gathers and TP's all-reduces)."""
    path = tiny_path()
    layouts = [(2, 1, False), (1, 2, False), (2, 1, True), (1, 2, True)]
    _check(reference_update(path), run_distributed(_worker, 2, path, layouts))


def test_update_invariant_on_4_processes():
    path = tiny_path()
    _check(reference_update(path), run_distributed(_worker, 4, path, [(2, 2, False)]))

"""The PPO update under FSDP when data-parallel ranks hold different numbers of micro-batches
(rank 0: one short sequence, rank 1: three long ones, one per micro-batch): every rank runs as
many forward/backward passes as the busiest one, in lockstep, so nothing hangs, and the update
equals the single-process update over all four sequences."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import parallelize_model
from earl_lightning.train.update import Models, UpdateConfig, ppo_update
from tests.distributed.launch import run_distributed
from tests.updates import reference_update

pytestmark = pytest.mark.distributed

LENGTHS = [(0, 10), (1, 40), (1, 36), (1, 44)]  # (rank, tokens)
CFG = reference_update(micro_batch_tokens=48, max_grad_norm=0.0)


class _Opt:
    """Lightning's optimizer wrapper, as far as ppo_update uses it (``step`` and the wrapped ``optimizer``)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def update(models: Models, batch: ExperienceBatch, cfg: UpdateConfig, reducer: Reducer) -> dict:
    opt = _Opt(torch.optim.SGD(models.parameters(), lr=0.5))
    return ppo_update(models, opt, None, batch, cfg, reducer, lambda loss: loss.backward())


def batch(rows: list[int]) -> ExperienceBatch:
    g = torch.Generator().manual_seed(7)
    seqs = []
    for _, n in LENGTHS:
        ids = torch.randint(3, 100, (n,), generator=g)
        mask = torch.zeros(n)
        mask[n // 2 :] = 1.0
        seqs.append(
            (
                ids,
                mask,
                0.3 * torch.randn(n, generator=g),
                torch.randn(1, generator=g).expand(n).clone(),
                0.1 * torch.randn(n, generator=g),
                torch.randn(n, generator=g),
            )
        )
    pick = [seqs[i] for i in rows]
    return ExperienceBatch.from_sequences(
        {
            "input_ids": [s[0] for s in pick],
            "action_mask": [s[1] for s in pick],
            "old_logprobs": [s[2] for s in pick],
            "advantages": [s[3] for s in pick],
            "values": [s[4] for s in pick],
            "returns": [s[5] for s in pick],
        },
        {"rewards": torch.zeros(len(pick))},
    )


def _params(models: Models) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    named = [(f"policy.{n}", p) for n, p in models.policy.named_parameters()]
    if models.value_head is not None:
        named += [(f"value_head.{n}", p) for n, p in models.value_head.named_parameters()]
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named
    }


def value_head() -> torch.nn.Linear:
    torch.manual_seed(3)
    return torch.nn.Linear(64, 1)


def _worker(
    rank: int,
    world: int,
    path: str,
    with_value: bool = False,
    cfg: UpdateConfig = CFG,
    tp: int = 1,
    owner: int | None = None,
):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    layout = Layout(dp=2, tp=tp)
    parallelize_model(
        model, mesh=init_device_mesh("cpu", (2, tp), mesh_dim_names=("dp", "tp")), layout=layout
    )
    dp_rank, _ = layout.coords(dist.get_rank())  # the ranks of one TP group hold the same rows
    # ``owner``: the dp rank that holds every row (the other holds none)
    mine = [i for i, (r, _) in enumerate(LENGTHS) if (r if owner is None else owner) == dp_rank]
    models = Models(model, value_head() if with_value else None)
    out = update(models, batch(mine), cfg, Reducer(layout))
    full = _params(models)  # a collective: every rank gathers
    return ({n: p.numpy() for n, p in full.items()}, out["grad_norm"]) if rank == 0 else None


def test_uneven_micro_batches_do_not_hang_and_match_one_process():
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    assert [
        len(
            batch([i for i, (r, _) in enumerate(LENGTHS) if r == k]).split_by_tokens(
                CFG.micro_batch_tokens
            )
        )
        for k in (0, 1)
    ] == [1, 3]
    ref = Models(AutoModelForCausalLM.from_pretrained(path))
    before = _params(ref)
    update(ref, batch(list(range(len(LENGTHS)))), CFG, Reducer())
    expected = _params(ref)
    got = run_distributed(_worker, 2, path, timeout=120)[0][0]
    assert sum((expected[n] - before[n]).abs().sum().item() for n in before) > 0
    for name, value in expected.items():
        torch.testing.assert_close(
            torch.from_numpy(got[name]), value, rtol=1e-4, atol=1e-6, msg=name
        )


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2xtp2"])
def test_value_head_and_gradient_clipping_under_fsdp_match_one_process(tp):
    """PPO's value head is a plain replicated module beside the FSDP-sharded policy: clipping by the
    global norm must combine both kinds of gradient (torch refuses to mix them in one call). Under
    FSDP x TP (4 processes) the policy's own gradients sit on two meshes as well: (dp, tp) for the
    TP-sharded weights, dp for the norms'."""
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    cfg = reference_update(micro_batch_tokens=48, max_grad_norm=0.05, value_coef=1.0)
    ref = Models(AutoModelForCausalLM.from_pretrained(path), value_head())
    out = update(ref, batch(list(range(len(LENGTHS)))), cfg, Reducer())
    expected = _params(ref)
    assert out["grad_norm"] > 0.05  # the clip is active
    got, norm = run_distributed(_worker, 2 * tp, path, True, cfg, tp, timeout=240)[0]
    assert norm == pytest.approx(out["grad_norm"], rel=1e-4)
    assert {"value_head.weight", "value_head.bias"} <= set(got)
    for name, value in expected.items():
        torch.testing.assert_close(
            torch.from_numpy(got[name]), value, rtol=1e-4, atol=1e-6, msg=name
        )


def test_a_rank_without_rows_takes_part_and_the_update_matches_one_process():
    """Every row on dp rank 0, none on rank 1 (a rank whose rows were all skipped as too long
    for the context): rank 1 runs zero-loss passes in step with rank 0's micro-batches, and the
    update equals the one-process update over the same rows."""
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_invariance_layouts import tiny_path

    path = tiny_path()
    assert batch([]).num_seqs == 0
    ref = Models(AutoModelForCausalLM.from_pretrained(path))
    update(ref, batch(list(range(len(LENGTHS)))), CFG, Reducer())
    expected = _params(ref)
    got = run_distributed(_worker, 2, path, False, CFG, 1, 0, timeout=120)[0][0]
    for name, value in expected.items():
        torch.testing.assert_close(
            torch.from_numpy(got[name]), value, rtol=1e-4, atol=1e-6, msg=name
        )

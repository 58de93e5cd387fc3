"""Property tests of the dispatcher on 2-4 gloo processes.

Hypothesis draws the cases in the test process (world size, source and destination layouts that
differ, per-rank sequence counts including empty ranks, lengths from 1 to thousands, TP delivery
mode, GRPO groups kept whole or not). All cases of one world size then run inside ONE spawned
process group, which keeps the file fast. For every case:

- every sequence is delivered to exactly one dp group, and the members of a destination TP group
  hold identical batches (same digest of every field);
- every delivered row equals the input row exactly (each worker rebuilds all input batches);
- rows arrive in ascending canonical order (source dp rank, then index);
- the decentralized result equals both centralized baselines' field by field;
- with >= 64 sequences the token imbalance is within 5% of the best any partition can do
  (the mean, unless one sequence or the pigeonhole bound forces more).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.dispatch.centralized import CentralizedDispatcher
from earl_lightning.dispatch.dispatcher import Dispatcher
from earl_lightning.dispatch.planner import TP_MODES
from earl_lightning.parallel.layout import Layout
from tests.distributed.launch import run_distributed

EXAMPLES_PER_WORLD = 10

pytestmark = pytest.mark.distributed


@st.composite
def dispatch_cases(draw, world: int) -> dict:
    layouts = Layout.factorizations(world)
    src, dst = draw(st.sampled_from(layouts)), draw(st.sampled_from(layouts))
    many = draw(st.booleans())
    per_rank = st.integers(64 // src.dp + 1, 80) if many else st.integers(0, 12)
    return {
        "world": world,
        "src": (src.dp, src.tp),
        "dst": (dst.dp, dst.tp),
        "counts": draw(st.lists(per_rank, min_size=src.dp, max_size=src.dp)),
        "max_len": draw(st.sampled_from([1, 16, 300, 3000])),
        "groups": draw(st.integers(1, 20)),
        "keep_groups": draw(st.booleans()) if not many else False,
        "tp_mode": draw(st.sampled_from(TP_MODES)),
        "locality": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**20)),
    }


def draw_cases(world: int, n: int) -> list[dict]:
    out: list[dict] = []

    @settings(max_examples=n, database=None, deadline=None)
    @given(dispatch_cases(world))
    def collect(case):
        out.append(case)

    collect()
    # Always one large case with wildly different lengths, whatever hypothesis drew.
    out.append(
        {
            "world": world,
            "src": (world, 1),
            "dst": (1, world) if world < 4 else (2, 2),
            "counts": [80 // world + 1] * world,
            "max_len": 3000,
            "groups": 16,
            "keep_groups": False,
            "tp_mode": "auto",
            "locality": True,
            "seed": 12345,
        }
    )
    return out


def build_batch(case: dict, dp_rank: int) -> ExperienceBatch:
    """Source dp group ``dp_rank``'s batch: a pure function of the case (every rank can rebuild it)."""
    g = torch.Generator().manual_seed(case["seed"] * 1000 + dp_rank)
    n = case["counts"][dp_rank]
    # log-uniform lengths: sequences of very different sizes side by side
    lens = (
        torch.exp(torch.rand(n, generator=g) * torch.log(torch.tensor(float(case["max_len"]))))
        .long()
        .clamp(min=1)
    )
    toks = {
        "input_ids": [torch.randint(0, 104, (k,), generator=g) for k in lens.tolist()],
        "action_mask": [torch.rand(k, generator=g) > 0.3 for k in lens.tolist()],
        "logprobs": [-torch.rand(k, generator=g) for k in lens.tolist()],
        "values": [torch.randn(k, generator=g).to(torch.bfloat16) for k in lens.tolist()],
    }
    seqs = {
        "rewards": torch.randn(n, generator=g),
        "group_ids": torch.randint(0, case["groups"], (n,), generator=g),
        "episode_ids": torch.arange(n) + 10_000 * dp_rank,
        "truncated": torch.rand(n, generator=g) > 0.5,
        "num_turns": torch.randint(1, 5, (n,), generator=g).to(torch.int32),
    }
    if n == 0:
        return ExperienceBatch.empty(
            build_batch({**case, "counts": [1] * len(case["counts"])}, 0).schema()
        )
    return ExperienceBatch.from_sequences(toks, seqs)


def digest(b: ExperienceBatch) -> str:
    h = hashlib.sha256(b.cu_seqlens.numpy().tobytes())
    for name in sorted(b.tokens):
        h.update(b.tokens[name].contiguous().view(torch.uint8).numpy().tobytes())
    for name in sorted(b.seqs):
        h.update(b.seqs[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def equal(a: ExperienceBatch, b: ExperienceBatch) -> bool:
    return (
        torch.equal(a.cu_seqlens, b.cu_seqlens)
        and a.schema() == b.schema()
        and all(torch.equal(a.tokens[k], b.tokens[k]) for k in a.tokens)
        and all(torch.equal(a.seqs[k], b.seqs[k]) for k in a.seqs)
    )


def check_rows_match_input(out: ExperienceBatch, case: dict) -> None:
    """Each delivered row is the input row with the same episode id, field for field."""
    inputs = {d: build_batch(case, d) for d in range(case["src"][0])}
    for j, ep in enumerate(out.seqs["episode_ids"].tolist()):
        expected = inputs[ep // 10_000].select([ep % 10_000])
        assert equal(out.select([j]), expected), (
            f"row of episode {ep} differs from the input; case {case}"
        )


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        src, dst = Layout(*case["src"]), Layout(*case["dst"])
        batch = build_batch(case, src.coords(rank)[0])
        kw = dict(src=src, keep_groups=case["keep_groups"])
        dispatcher = Dispatcher(tp_mode=case["tp_mode"], locality=case["locality"])
        out = dispatcher.exchange(batch, dst, **kw)
        check_rows_match_input(out, case)
        tensor = CentralizedDispatcher(method="tensor", locality=case["locality"]).exchange(
            batch, dst, **kw
        )
        obj = CentralizedDispatcher(method="object", locality=case["locality"]).exchange(
            batch, dst, **kw
        )
        plan = dispatcher.last_plan
        results.append(
            {
                "episodes": out.seqs["episode_ids"].tolist(),
                "digest": digest(out),
                "same_as_tensor": equal(out, tensor),
                "same_as_object": equal(out, obj),
                "dp_tokens": plan.dp_tokens(),
                "lengths": plan.lengths,
                "groups": dict(
                    zip(out.seqs["episode_ids"].tolist(), out.seqs["group_ids"].tolist())
                ),
                "imbalance": dispatcher.last_stats["imbalance"],
            }
        )
    return results


def lower_bound(lengths: list[int], k: int) -> float:
    top = sorted(lengths, reverse=True)
    pair = top[k - 1] + top[k] if len(top) > k else 0
    return max(sum(lengths) / k, top[0] if top else 0, pair)


def check_case(case: dict, per_rank: list[dict]) -> None:
    dst = Layout(*case["dst"])
    every = sorted(10_000 * d + j for d, n in enumerate(case["counts"]) for j in range(n))
    delivered = []
    for g in range(dst.dp):
        members = [per_rank[r] for r in dst.tp_group_ranks(g)]
        assert len({m["digest"] for m in members}) == 1, f"TP group {g} members differ; case {case}"
        assert members[0]["episodes"] == sorted(members[0]["episodes"]), (
            f"order not canonical; case {case}"
        )
        delivered += members[0]["episodes"]
    assert sorted(delivered) == every, f"not every sequence delivered exactly once; case {case}"
    assert all(r["same_as_tensor"] and r["same_as_object"] for r in per_rank), (
        f"differs from centralized; {case}"
    )
    if case["keep_groups"]:
        owner = {}
        for g in range(dst.dp):
            for gid in per_rank[dst.rank_of(g, 0)]["groups"].values():
                assert owner.setdefault(gid, g) == g, (
                    f"group {gid} split across dp ranks; case {case}"
                )
    lengths = per_rank[0]["lengths"]
    if len(lengths) >= 64 and not case["keep_groups"]:
        assert max(per_rank[0]["dp_tokens"]) <= 1.05 * lower_bound(lengths, dst.dp), (
            f"imbalanced; case {case}"
        )


def check_world(world: int) -> None:
    cases = draw_cases(world, EXAMPLES_PER_WORLD)
    results = run_distributed(run_cases, world, cases)
    for i, case in enumerate(cases):
        check_case(case, [results[r][i] for r in range(world)])


def test_dispatch_properties_world_2():
    check_world(2)


def test_dispatch_properties_world_3():
    check_world(3)


def test_dispatch_properties_world_4():
    check_world(4)


def run_after_uneven_groups(rank: int, world: int, case: dict) -> list[dict]:
    """Ranks 0 and 1 first make a group of their own (as a TP pair in broadcast mode does while the
    other pair is in direct mode), then all four take a TP-4 broadcast: members-only group creation
    named that group differently on the two pairs, and the four waited for each other forever."""
    if rank < 2:
        dist.new_group([0, 1], use_local_synchronization=True)
    return run_cases(rank, world, [case, case])  # the second exchange reuses the broadcast group


def test_broadcast_group_forms_after_ranks_made_different_groups():
    case = {
        "world": 4,
        "src": (4, 1),
        "dst": (1, 4),
        "counts": [5, 3, 0, 7],
        "max_len": 300,
        "groups": 4,
        "keep_groups": False,
        "tp_mode": "broadcast",
        "locality": True,
        "seed": 7,
    }
    results = run_distributed(run_after_uneven_groups, 4, case, timeout=120.0)
    for i in range(2):
        check_case(case, [results[r][i] for r in range(4)])
        # the TP-4 group holds one batch
        assert len({results[r][i]["digest"] for r in range(4)}) == 1

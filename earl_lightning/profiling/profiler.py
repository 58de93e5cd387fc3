"""Measure each RL stage's throughput per (context length x number of sequences x layout).

The EARL paper profiled its rollout engine once per tensor-parallel degree and context length
and then looked the table up; this profiler does it for every stage, with the project's own code
paths, so the numbers are what the trainer will see:

- rollout: the HF generation backend (:class:`HFBackend`) generating ``gen_len`` tokens after a
  prompt of ``context`` tokens, under the layout's TP replica (dp-replicated);
- experience: :func:`fill_logprobs` (the no-grad, micro-batched forward of the experience stage);
- train: :func:`forward_micro_batch` + a policy-gradient loss + backward + AdamW step, under the
  layout's FSDP x TP sharding and its ``micro_batch_tokens``.

Work is split like the trainer splits it: ``num_seqs`` sequences over the ``dp`` ranks (TP peers
share theirs). Each cell's time is the slowest rank's (a stage ends when its last rank does).
Tokens per second use :func:`work_tokens`' units (generated tokens for rollout, all tokens for
experience and train). Cells run from the cheapest up, every layout at one cell before the next
cell, and stop when ``budget_s`` is spent: a short budget still yields a table covering every
layout at the small sizes (the table clamps beyond its measured range).

On one process only ``dp1xtp1`` exists; launch under ``torchrun --nproc-per-node N`` to profile
every dp x tp factorization of N. No Lightning here: plain torch.distributed when it is initialized.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.core.checks import check_count, check_number, is_int
from earl_lightning.parallel.collectives import Reducer, broadcast_object, global_rank, world_size
from earl_lightning.parallel.layout import STAGES, Layout, check_stage
from earl_lightning.parallel.parallelize import (
    model_heads,
    parallelize_model,
    set_activation_checkpointing,
)
from earl_lightning.parallel.throughput import ProfileTable, layout_key
from earl_lightning.rollout.backends.base import GenRequest, SamplingConfig
from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.train.forward import fill_logprobs, forward_micro_batch, zero_loss

# ids below are the tiny tokenizer's pad / bos / eos: never part of a synthetic context
_FIRST_TOKEN = 3


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure.

    Args:
        contexts: context lengths in tokens (rollout: the prompt; experience/train: the sequence).
        num_seqs: sequences per step over all ranks.
        stages: which stages to profile.
        gen_len: tokens generated per rollout request.
        repeats: timed runs per cell (the median counts), after one untimed warm-up per layout.
    """

    contexts: Sequence[int] = (256, 1024, 4096)
    num_seqs: Sequence[int] = (8,)
    stages: Sequence[str] = STAGES
    gen_len: int = 8
    repeats: int = 1

    def __post_init__(self) -> None:
        for name in ("contexts", "num_seqs"):
            vals = list(getattr(self, name))
            if not vals or not all(is_int(v) and v >= 2 for v in vals):
                raise ValueError(
                    f"`{name}` must be a non-empty list of integers >= 2, got {vals!r}"
                )
            object.__setattr__(self, name, tuple(sorted(set(vals))))
        for s in self.stages:
            check_stage(s, arg="stages")
        object.__setattr__(self, "stages", tuple(s for s in STAGES if s in self.stages))
        check_count("gen_len", self.gen_len)
        check_count("repeats", self.repeats)

    def cells(self) -> list[tuple[int, int]]:
        """(context, num_seqs) from the cheapest to the dearest."""
        return sorted(
            ((c, n) for c in self.contexts for n in self.num_seqs),
            key=lambda cn: (cn[0] * cn[1], cn),
        )


@dataclass
class ProfileRun:
    """The outcome: the table and what was left out because the budget ran out."""

    table: ProfileTable
    measured: int = 0
    skipped: list[tuple[str, int, int, str]] = field(default_factory=list)
    seconds: float = 0.0


def _rank_world() -> tuple[int, int]:
    return global_rank(), world_size()


def _max_over_ranks(x: float) -> float:
    return float(Reducer().max(torch.tensor([x], dtype=torch.float64))[0])


def _agree(flag: bool) -> bool:
    """Rank 0's decision for everyone (each rank's clock differs slightly)."""
    return bool(broadcast_object(flag))


class _Placements:
    """A model copy per (stage kind, dp, tp), placed like the trainer places it: inference stages
    get a TP replica (dp-replicated), train gets FSDP x TP with an AdamW optimizer."""

    def __init__(self, model_factory: Callable[[], nn.Module], device: torch.device) -> None:
        self.factory, self.device = model_factory, device
        self._meshes: dict[tuple[int, int], Any] = {}
        self._models: dict[tuple[bool, int, int], tuple[nn.Module, Any]] = {}

    def mesh(self, layout: Layout):
        from torch.distributed.device_mesh import init_device_mesh

        key = (layout.dp, layout.tp)
        if layout.world_size == 1:
            return None
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(self.device.type, key, mesh_dim_names=("dp", "tp"))
        return self._meshes[key]

    def get(self, layout: Layout, train: bool) -> tuple[nn.Module, Any]:
        key = (train, layout.dp, layout.tp)
        if key not in self._models:
            # every rank builds the same weights, so sharding them needs no broadcast
            torch.manual_seed(0)
            model = self.factory().to(self.device)
            placement = Layout(dp=layout.dp, tp=layout.tp)
            # Train copies are wrapped for checkpointing once; run() switches recomputation per layout.
            parallelize_model(
                model,
                mesh=self.mesh(placement),
                layout=placement,
                fsdp=train,
                checkpoint_switchable=train,
            )
            if train:
                model.train()
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
            else:
                model.eval().requires_grad_(False)
                opt = None
            self._models = {
                k: v for k, v in self._models.items() if k[0] != train
            }  # one placement alive per kind
            self._models[key] = (model, opt)
        return self._models[key]


def _local_count(num_seqs: int, layout: Layout, rank: int) -> int:
    """Sequences of this rank's dp group: an even split, remainders to the first groups."""
    dp_rank = layout.coords(rank)[0]
    return num_seqs // layout.dp + (1 if dp_rank < num_seqs % layout.dp else 0)


def _synthetic_batch(n: int, context: int, vocab: int, gen: torch.Generator) -> ExperienceBatch:
    """``n`` sequences of ``context`` tokens; the last quarter is the policy's (action mask 1)."""
    ids = torch.randint(_FIRST_TOKEN, vocab, (n, context), generator=gen)
    mask = torch.zeros(n, context)
    mask[:, context - max(1, context // 4) :] = 1.0
    adv = torch.randn(n, generator=gen)
    toks = {
        "input_ids": list(ids),
        "action_mask": list(mask),
        "old_logprobs": [torch.zeros(context)] * n,
        "advantages": [torch.full((context,), float(a)) for a in adv],
    }
    return ExperienceBatch.from_sequences(toks, {"rewards": adv.clone()})


class StageProfiler:
    """Runs one stage once under one layout and returns the slowest rank's seconds and the work
    tokens done (global)."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        tokenizer: Any,
        device: torch.device | str = "cpu",
        seed: int = 0,
        scored_last_layer: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.scored = scored_last_layer  # the forwards as the trainer runs them (train/scored.py)
        self.placements = _Placements(model_factory, self.device)
        self.tokenizer, self.seed = tokenizer, seed

    def run(
        self, stage: str, layout: Layout, context: int, num_seqs: int, gen_len: int
    ) -> tuple[float, float]:
        rank, _ = _rank_world()
        n = _local_count(num_seqs, layout, rank)
        gen = torch.Generator().manual_seed(
            self.seed * 7919 + context * 31 + num_seqs + layout.coords(rank)[0]
        )
        model, opt = self.placements.get(layout, train=stage == "train")
        if stage == "train":
            set_activation_checkpointing(model, layout.activation_checkpointing)
        vocab = model.config.vocab_size
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if stage == "rollout":
            work = self._rollout(model, n, context, gen_len, vocab, gen, layout)
        elif stage == "experience":
            batch = _synthetic_batch(n, context, vocab, gen).to(self.device) if n else None
            if batch is not None:
                fill_logprobs(
                    model,
                    batch,
                    name="old_logprobs",
                    temperature=1.0,
                    micro_batch_tokens=layout.sizing_tokens,
                    scored=self.scored,
                )
            work = float(n * context)
        else:
            work = self._train(model, opt, n, context, vocab, gen, layout)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = _max_over_ranks(time.perf_counter() - start)
        return seconds, _sum_work(work, layout)

    def _rollout(self, model, n, context, gen_len, vocab, gen, layout) -> float:
        backend = HFBackend(model, self.tokenizer, reuse_kv=False)
        ids = torch.randint(_FIRST_TOKEN, vocab, (max(n, 1), context), generator=gen).tolist()
        requests = [GenRequest(key=i, prompt_ids=ids[i]) for i in range(n)]
        # TP peers must sample the same tokens: the seed depends on the dp group only.
        sampling = SamplingConfig(
            max_new_tokens=gen_len, seed=self.seed + layout.coords(_rank_world()[0])[0]
        )
        outs = backend.generate(requests, sampling) if requests else []
        backend.release(None)
        return float(sum(len(o.token_ids) for o in outs))

    def _train(self, model, opt, n, context, vocab, gen, layout) -> float:
        # FSDP / TP need every rank in every forward: pad the micro-batch count with zero-loss
        # passes, as the trainer's update does.
        batch = _synthetic_batch(max(n, 1), context, vocab, gen).to(self.device)
        micro = batch.split_by_tokens(layout.sizing_tokens) if n else []
        for i in range(Reducer().agree_count(len(micro))):
            if i >= len(micro):
                zero_loss(model).backward()
                continue
            res = forward_micro_batch(model, micro[i], temperature=1.0, scored=self.scored)
            adv, mask = micro[i].tokens["advantages"], micro[i].tokens["action_mask"]
            (-(res["logprobs"] * adv * mask).sum() / max(1.0, float(mask.sum()))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(n * context)


def _sum_work(work: float, layout: Layout) -> float:
    """Global work: TP peers did the same sequences, so each TP group counts once."""
    return Reducer(layout).sum_floats([work])[0]


def profile_stages(
    model_factory: Callable[[], nn.Module],
    tokenizer: Any,
    *,
    layouts: Sequence[Layout],
    grid: ProfileGrid = ProfileGrid(),
    model_name: str = "model",
    budget_s: float | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    scored_last_layer: bool = True,
    log: Callable[[str], None] | None = None,
) -> ProfileRun:
    """Measure every (stage, cell, layout) of ``grid`` until ``budget_s`` seconds are spent.

    ``model_factory()`` builds the model (its weights do not matter, only its shapes); it is called
    once per placement, on every rank, under the same seed. ``layouts`` must all span the world.
    ``scored_last_layer``: the experience and train forwards take the scored last layer where it
    applies, as the trainer's do under ``optim.scored_last_layer`` (a quarter of each synthetic
    sequence is the policy's).
    """
    rank, world = _rank_world()
    layouts = _check_layouts(layouts, world, model_factory)
    check_number("budget_s", budget_s, low=0, strict=True, optional=True, unit=" of seconds")
    run = ProfileRun(ProfileTable(model_name, world, device=_describe(torch.device(device), world)))
    prof = StageProfiler(model_factory, tokenizer, device, seed, scored_last_layer)
    start = time.perf_counter()
    for stage in grid.stages:
        # Checkpointing changes only the train stage (the others run without autograd).
        stage_layouts = [
            lay for lay in layouts if stage == "train" or not lay.activation_checkpointing
        ]
        # warm-up: first calls pay for lazy initialization, not throughput
        for layout in stage_layouts:
            prof.run(stage, layout, grid.contexts[0], grid.num_seqs[0], 1)
        for (ctx, nseq), layout in _schedule(grid, stage_layouts):
            if not _agree(budget_s is None or time.perf_counter() - start < budget_s):
                run.skipped.append((stage, ctx, nseq, layout_key(layout)))
                continue
            times = []
            for _ in range(grid.repeats):
                secs, work = prof.run(stage, layout, ctx, nseq, grid.gen_len)
                times.append((secs, work))
            secs, work = sorted(times)[len(times) // 2]
            run.table.add(stage, ctx, nseq, layout, max(work, 1.0) / max(secs, 1e-9))
            run.measured += 1
            if log is not None and rank == 0:
                log(
                    f"{stage:10s} ctx={ctx:6d} seqs={nseq:4d} {layout_key(layout):18s} "
                    f"{run.table.lookup(stage, layout, ctx, nseq):10.0f} tok/s ({secs:.3f}s)"
                )
    run.seconds = time.perf_counter() - start
    return run


def _schedule(
    grid: ProfileGrid, layouts: Sequence[Layout]
) -> Iterator[tuple[tuple[int, int], Layout]]:
    for cell in grid.cells():
        for layout in layouts:
            yield cell, layout


def _check_layouts(
    layouts: Sequence[Layout], world: int, model_factory: Callable[[], nn.Module]
) -> list[Layout]:
    layouts = list(layouts)
    if not layouts:
        raise ValueError("`layouts` must be a non-empty list of Layout")
    for i, lay in enumerate(layouts):
        if not isinstance(lay, Layout):
            raise ValueError(f"`layouts[{i}]` must be a Layout, got {lay!r}")
        lay.check_world(world, arg=f"layouts[{i}]")
    heads, kv = model_heads(copy.deepcopy(model_factory()))
    for i, lay in enumerate(layouts):
        lay.check_heads(heads, kv, arg=f"layouts[{i}]")
    return layouts


def _describe(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    return f"{world} CPU process(es), {torch.get_num_threads()} thread(s) each"

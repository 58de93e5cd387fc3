"""The single-controller baseline: gather everything on one rank, then scatter it.

This is what frameworks with a central driver do between RL stages, and what the EARL paper
measured at over 20 minutes per iteration at 32K context on 1,024 GPUs. It stays here as the
reference the decentralized :class:`~earl_lightning.dispatch.dispatcher.Dispatcher` is tested and
benchmarked against: both run the same plan, so they deliver exactly the same rows in the same
order. Two forms:

- ``method="tensor"``: the packed per-dtype buffers through ``gather`` / ``scatter`` collectives
  (padded to the largest rank's size, as those collectives require);
- ``method="object"``: pickled batches through ``gather_object`` / ``scatter_object_list``.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
import torch.distributed as dist

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.dispatch.dispatcher import (
    check_layout,
    chunk_elements,
    dispatch_stats,
    gather_metadata,
    pack_chunks,
    unpack_chunks,
    wire_bytes_per_row,
    wire_schema,
)
from earl_lightning.dispatch.planner import DispatchPlan, make_plan
from earl_lightning.parallel.collectives import comm_device
from earl_lightning.parallel.layout import Layout

CENTRAL_METHODS = ("tensor", "object")


class CentralizedDispatcher:
    """Gather-to-``root``-then-scatter behind the :class:`Dispatcher` interface.

    ``locality`` must match the decentralized Dispatcher's to get the same assignment.
    ``last_stats`` has the Dispatcher's keys; bytes count what the collectives move (padding
    included for ``"tensor"``, the unpadded payload for ``"object"``, whose pickles add a little).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        method: Literal["tensor", "object"] = "tensor",
        root: int = 0,
        locality: bool = True,
    ) -> None:
        if method not in CENTRAL_METHODS:
            raise ValueError(f"`method` must be one of {list(CENTRAL_METHODS)}, got {method!r}")
        self.group, self.method, self.root, self.locality = group, method, root, locality
        self.last_stats: dict[str, float] = {}

    def exchange(
        self,
        batch: ExperienceBatch,
        to: Layout,
        *,
        src: Layout | None = None,
        keep_groups: bool = False,
    ) -> ExperienceBatch:
        start = time.perf_counter()
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        to = check_layout(to, "to", world)
        src = check_layout(Layout(dp=world, tp=1) if src is None else src, "src", world)
        if self.method == "object":
            batch.validate()  # the tensor method validates collectively in gather_metadata
        run = self._exchange_tensor if self.method == "tensor" else self._exchange_object
        out, plan = run(batch, to, src, keep_groups)
        self.last_stats = dispatch_stats(plan, rank, time.perf_counter() - start, out)
        return out

    # -- tensors through gather / scatter --------------------------------------------------------
    def _exchange_tensor(
        self, batch: ExperienceBatch, to: Layout, src: Layout, keep_groups: bool
    ) -> tuple[ExperienceBatch, DispatchPlan]:
        rank = dist.get_rank(self.group)
        batch, lengths, group_ids = gather_metadata(batch, self.group, keep_groups)
        plan = _central_plan(lengths, group_ids, batch, src, to, keep_groups, self.locality)
        schema = batch.schema()
        primary = [src.tp_group_ranks(d)[0] for d in range(src.dp)]
        # Non-primary replicas hold copies the controller already gets from the primary.
        mine = list(range(batch.num_seqs)) if rank in primary else []
        inbound = [lengths[r] if r in primary else [] for r in range(plan.world_size)]
        gathered = self._gather(pack_chunks(batch, [mine]), inbound, schema)
        outbound = [[i for i in plan.rows_of(to.coords(d)[0])] for d in range(plan.world_size)]
        if rank == self.root:
            full = unpack_chunks(
                {dt: torch.cat(parts) for dt, parts in gathered.items()},
                schema,
                [len(x) for x in inbound],
                [sum(x) for x in inbound],
            )
            packed = pack_chunks(full, outbound)
            del full, gathered
        else:
            packed = None
        mine_out = outbound[rank]
        received = self._scatter(
            packed, [[plan.lengths[i] for i in rows] for rows in outbound], schema
        )
        out = unpack_chunks(
            received, schema, [len(mine_out)], [sum(plan.lengths[i] for i in mine_out)]
        )
        _set_central_traffic(
            plan,
            self.root,
            inbound,
            [[plan.lengths[i] for i in r] for r in outbound],
            batch,
            padded=True,
        )
        return out, plan

    def _gather(
        self, packed, inbound: list[list[int]], schema
    ) -> dict[torch.dtype, list[torch.Tensor]]:
        """Padded gather of each rank's buffer per dtype; on the root, the unpadded parts in rank order."""
        rank, device = dist.get_rank(self.group), comm_device(self.group)
        out = {}
        for dtype, fields in wire_schema(schema).items():
            sizes = [chunk_elements(fields, len(x), sum(x)) for x in inbound]
            width = max(sizes)
            buffer = torch.zeros(width, dtype=dtype, device=device)
            buffer[: sizes[rank]] = packed[dtype][0]
            parts = (
                [torch.empty(width, dtype=dtype, device=device) for _ in sizes]
                if rank == self.root
                else None
            )
            dist.gather(buffer, parts, group_dst=self.root, group=self.group)
            out[dtype] = [p[:n] for p, n in zip(parts, sizes)] if rank == self.root else []
        return out

    def _scatter(
        self, packed, outbound: list[list[int]], schema
    ) -> dict[torch.dtype, torch.Tensor]:
        """Padded scatter of each destination's buffer per dtype from the root."""
        rank, device = dist.get_rank(self.group), comm_device(self.group)
        out = {}
        for dtype, fields in wire_schema(schema).items():
            sizes = [chunk_elements(fields, len(x), sum(x)) for x in outbound]
            width = max(sizes)
            parts = None
            if rank == self.root:
                parts = [torch.zeros(width, dtype=dtype, device=device) for _ in sizes]
                for part, piece in zip(parts, torch.split(packed[dtype][0], sizes)):
                    part[: piece.numel()] = piece
            buffer = torch.empty(width, dtype=dtype, device=device)
            dist.scatter(buffer, parts, group_src=self.root, group=self.group)
            out[dtype] = buffer[: sizes[rank]]
        return out

    # -- pickled objects through gather_object / scatter_object_list ------------------------------
    def _exchange_object(
        self, batch: ExperienceBatch, to: Layout, src: Layout, keep_groups: bool
    ) -> tuple[ExperienceBatch, DispatchPlan]:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        primary = {src.tp_group_ranks(d)[0] for d in range(src.dp)}
        batches: list | None = [None] * world if rank == self.root else None
        dist.gather_object(
            batch if rank in primary else None, batches, group_dst=self.root, group=self.group
        )
        pieces: list | None = [None] * world if rank == self.root else None
        if rank == self.root:
            # The controller alone plans, from the batches it now holds: what a single driver does.
            plan = self._plan_from_batches(batches, src, to, keep_groups)
            full = ExperienceBatch.concat(
                [batches[src.tp_group_ranks(d)[0]] for d in range(src.dp)]
            )
            pieces = [(full.select(plan.rows_of(to.coords(d)[0])), plan) for d in range(world)]
        received: list = [None]
        dist.scatter_object_list(received, pieces, group_src=self.root, group=self.group)
        out, plan = received[0]
        return out, plan

    def _plan_from_batches(
        self, batches: list, src: Layout, to: Layout, keep_groups: bool
    ) -> DispatchPlan:
        present = [b for b in batches if b is not None]
        template = next((b for b in present if b.num_seqs), present[0])
        if keep_groups and "group_ids" not in template.seqs:
            raise ValueError("`keep_groups=True` needs a `group_ids` sequence field in the batch")
        for r, b in enumerate(batches):
            if b is not None and b.num_seqs == 0 and b.schema() != template.schema():
                batches[r] = ExperienceBatch.empty(template.schema())
        # Replicas sent nothing: the controller treats them as holding their primary's batch.
        lengths, gids = [], []
        for r in range(len(batches)):
            b = batches[src.tp_group_ranks(src.coords(r)[0])[0]]
            lengths.append(b.seq_lens.tolist())
            gids.append(
                b.seqs["group_ids"].tolist() if "group_ids" in b.seqs else [-1] * b.num_seqs
            )
        plan = _central_plan(lengths, gids, template, src, to, keep_groups, self.locality)
        inbound = [lengths[r] if src.coords(r)[1] == 0 else [] for r in range(len(batches))]
        outbound = [
            [plan.lengths[i] for i in plan.rows_of(to.coords(d)[0])] for d in range(len(batches))
        ]
        _set_central_traffic(plan, self.root, inbound, outbound, template, padded=False)
        return plan


def _central_plan(
    lengths,
    group_ids,
    batch: ExperienceBatch,
    src: Layout,
    to: Layout,
    keep_groups: bool,
    locality: bool,
) -> DispatchPlan:
    """The decentralized dispatcher's plan, so both paths deliver the same rows."""
    token_bytes, seq_bytes = wire_bytes_per_row(batch.schema())
    return make_plan(
        lengths,
        group_ids,
        src=src,
        dst=to,
        token_bytes=token_bytes,
        seq_bytes=seq_bytes,
        keep_groups=keep_groups,
        tp_mode="direct",
        locality=locality,
    )


def _set_central_traffic(
    plan: DispatchPlan,
    root: int,
    inbound: list[list[int]],
    outbound: list[list[int]],
    batch: ExperienceBatch,
    *,
    padded: bool,
) -> None:
    """Replace the plan's all-to-all traffic with what gather-then-scatter moves."""
    token_bytes, seq_bytes = wire_bytes_per_row(batch.schema())
    size = [
        [len(x) * seq_bytes + sum(x) * token_bytes for x in side] for side in (inbound, outbound)
    ]
    if padded:
        size = [[max(side)] * len(side) for side in size]
    plan.sent, plan.recv = list(size[0]), list(size[1])
    plan.sent[root] = sum(b for r, b in enumerate(size[1]) if r != root)
    plan.recv[root] = sum(b for r, b in enumerate(size[0]) if r != root)

"""The decentralized, layout-aware data dispatcher (EARL's all-to-all, for every tensor).

``Dispatcher().exchange(batch, to=layout, src=previous_layout)`` moves an
:class:`ExperienceBatch` from the layout that produced it to the layout that consumes it:

1. all-gather metadata only: per rank a small int64 header (sequence count, field checksum), then
   per sequence its token count and group id;
2. every rank computes the same :class:`~earl_lightning.dispatch.planner.DispatchPlan`;
3. one ``all_to_all_single`` per wire dtype: every field of one dtype, for every destination, packed
   into one flat buffer with split sizes taken from the plan; the sequence lengths travel too;
4. in destination TP groups the plan serves by broadcast, the root broadcasts what it received;
5. a local unpack into ascending canonical order (identical on every member of a TP group).

Nothing is ever gathered on one rank. The centralized baseline lives in ``centralized.py``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from earl_lightning.batches.experience import (
    ExperienceBatch,
    FieldSpec,
    describe_schema,
    group_by_wire_dtype,
    schema_fingerprint,
)
from earl_lightning.dispatch.planner import (
    TP_MODES,
    DispatchPlan,
    TpMode,
    broadcast_chain,
    make_plan,
)
from earl_lightning.parallel.collectives import collective_timeout, comm_device
from earl_lightning.parallel.layout import Layout

# Sequence lengths travel with the data so the receiver rebuilds cu_seqlens from what it received.
LENGTHS = FieldSpec("_seq_lens", "seq", torch.int64)


# ---- packing (shared with the centralized baseline) ---------------------------------------------
def wire_schema(batch_schema: tuple[FieldSpec, ...]) -> dict[torch.dtype, list[FieldSpec]]:
    """The batch's fields plus the lengths, grouped by the dtype they travel as."""
    return group_by_wire_dtype((*batch_schema, LENGTHS))


def chunk_elements(fields: list[FieldSpec], num_rows: int, num_tokens: int) -> int:
    """Wire elements one chunk (``num_rows`` sequences, ``num_tokens`` tokens) of ``fields`` takes."""
    return sum(f.width * (num_tokens if f.kind == "token" else num_rows) for f in fields)


def wire_bytes_per_row(batch_schema: tuple[FieldSpec, ...]) -> tuple[int, int]:
    """(bytes per token, bytes per sequence) on the wire, lengths included."""
    size = {f: torch.empty(0, dtype=f.dtype).element_size() for f in (*batch_schema, LENGTHS)}
    return (
        sum(s for f, s in size.items() if f.kind == "token"),
        sum(s for f, s in size.items() if f.kind == "seq"),
    )


def _field_values(batch: ExperienceBatch, f: FieldSpec) -> torch.Tensor:
    if f is LENGTHS:
        return batch.seq_lens
    return (batch.tokens if f.kind == "token" else batch.seqs)[f.name]


def pack_chunks(
    batch: ExperienceBatch, chunks: list[list[int]]
) -> dict[torch.dtype, tuple[torch.Tensor, list[int]]]:
    """One flat buffer per wire dtype holding, chunk after chunk, the chosen rows of every field.

    ``chunks[c]`` lists local row indices (a row may appear in several chunks). Returns
    ``{dtype: (buffer, elements per chunk)}``; inside a chunk the fields follow the schema order.
    Rows are gathered straight into the buffers (one copy of the payload; the only temporary is
    one chunk's token positions).
    """
    groups = wire_schema(batch.schema())
    lens = batch.seq_lens
    index = [torch.as_tensor(c, dtype=torch.long) for c in chunks]
    rows_per = [len(c) for c in chunks]
    toks_per = [int(lens[i].sum()) for i in index]
    sizes = {
        dt: [chunk_elements(fs, r, t) for r, t in zip(rows_per, toks_per)]
        for dt, fs in groups.items()
    }
    fields = [*batch.tokens.values(), *batch.seqs.values()]
    device = fields[0].device if fields else torch.device("cpu")
    buffers = {dt: torch.empty(sum(sz), dtype=dt, device=device) for dt, sz in sizes.items()}
    offset = dict.fromkeys(groups, 0)
    for rows in index:
        pos = token_positions(batch.cu_seqlens[:-1][rows], lens[rows]).to(device)
        rows = rows.to(device)
        for dt, fields in groups.items():
            for f in fields:
                src = f.to_wire(_field_values(batch, f).to(device)).view(-1, f.width)
                picks = pos if f.kind == "token" else rows
                n = picks.numel() * f.width
                dst = buffers[dt][offset[dt] : offset[dt] + n].view(-1, f.width)
                torch.index_select(src, 0, picks, out=dst)
                offset[dt] += n
    return {dt: (buffers[dt], sizes[dt]) for dt in groups}


def token_positions(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Positions of the tokens of rows starting at ``starts`` with ``lens`` tokens, row after row."""
    total = int(lens.sum())
    row_start_in_out = torch.cumsum(lens, 0) - lens
    return torch.arange(total) + torch.repeat_interleave(
        starts - row_start_in_out, lens, output_size=total
    )


def unpack_chunks(
    buffers: dict[torch.dtype, torch.Tensor],
    batch_schema: tuple[FieldSpec, ...],
    rows_per: list[int],
    toks_per: list[int],
) -> ExperienceBatch:
    """Inverse of :func:`pack_chunks`: the chunks' rows laid end to end, in chunk order."""
    parts: dict[FieldSpec, list[torch.Tensor]] = {}
    for dtype, fields in wire_schema(batch_schema).items():
        sizes = [
            f.width * (t if f.kind == "token" else r)
            for r, t in zip(rows_per, toks_per)
            for f in fields
        ]
        views = torch.split(buffers[dtype], sizes)
        for j, view in enumerate(views):
            parts.setdefault(fields[j % len(fields)], []).append(view)
    values = {
        f: f.from_wire(torch.cat(v)) if v else torch.zeros(0, dtype=f.dtype)
        for f, v in parts.items()
    }
    lens = values.pop(LENGTHS).cpu() if LENGTHS in values else torch.zeros(0, dtype=torch.long)
    # offsets stay on the host, like the container's
    cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    return ExperienceBatch(
        cu,
        {f.name: v for f, v in values.items() if f.kind == "token"},
        {f.name: v for f, v in values.items() if f.kind == "seq"},
    )


# ---- metadata (shared with the centralized baseline) --------------------------------------------
def gather_metadata(
    batch: ExperienceBatch, group: dist.ProcessGroup | None, keep_groups: bool
) -> tuple[ExperienceBatch, list[list[int]], list[list[int]]]:
    """All-gather every rank's per-sequence token counts and group ids (small int64 tensors only).

    Returns the batch (replaced by an empty batch with the common fields on a rank that holds no
    sequences and lacks them), and per rank its lengths and group ids (-1 without ``group_ids``).
    The batch is validated here, collectively: when one rank's batch is bad every rank raises
    (that rank with the container's message), instead of the others hanging in the next collective.
    """
    error = _local_error(batch, keep_groups)
    world = dist.get_world_size(group)
    device = comm_device(group)
    header = torch.tensor(
        [batch.num_seqs, schema_fingerprint(batch.schema()), error is not None],
        dtype=torch.long,
        device=device,
    )
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    bad = [r for r, h in enumerate(headers) if int(h[2])]
    if error is not None:
        raise error
    if bad:
        raise ValueError(
            f"the batch of rank(s) {bad} is invalid (see the error raised there); nothing was exchanged"
        )
    counts = [int(h[0]) for h in headers]
    batch = _agree_on_schema(batch, [int(h[1]) for h in headers], counts, group)
    gids = batch.seqs.get("group_ids", torch.full((batch.num_seqs,), -1, dtype=torch.long))
    table = torch.full((max(counts), 2), -1, dtype=torch.long, device=device)
    table[: batch.num_seqs, 0] = batch.seq_lens
    table[: batch.num_seqs, 1] = gids.long()
    tables = [torch.empty_like(table) for _ in range(world)]
    dist.all_gather(tables, table, group=group)
    return (
        batch,
        [t[:c, 0].tolist() for t, c in zip(tables, counts)],
        [t[:c, 1].tolist() for t, c in zip(tables, counts)],
    )


def _local_error(batch: ExperienceBatch, keep_groups: bool) -> ValueError | None:
    try:
        batch.validate()
    except ValueError as e:
        return e
    if keep_groups and "group_ids" not in batch.seqs:
        return ValueError(
            "`keep_groups=True` needs a `group_ids` sequence field in the batch; it has: "
            f"{describe_schema(batch.schema())}"
        )
    return None


def _agree_on_schema(
    batch: ExperienceBatch, prints: list[int], counts: list[int], group: dist.ProcessGroup | None
) -> ExperienceBatch:
    """Ranks holding sequences must agree on the fields; a rank holding none adopts theirs."""
    filled = sorted({p for p, c in zip(prints, counts) if c})
    if len(filled) > 1:
        raise ValueError(
            f"ranks hold batches with different fields (checksum per rank: {prints}); this rank "
            f"(rank {dist.get_rank(group)}) holds {describe_schema(batch.schema())}"
        )
    if all(p == prints[0] for p in prints):
        return batch
    # Rare path (a rank produced nothing and built its empty batch without the fields): fetch the
    # schema from a rank that holds sequences.
    schemas: list = [None] * len(prints)
    dist.all_gather_object(schemas, batch.schema(), group=group)
    schema = schemas[counts.index(max(counts))]
    return batch if batch.num_seqs else ExperienceBatch.empty(schema)


# ---- the dispatcher ------------------------------------------------------------------------------
def check_layout(layout: Layout, arg: str, world_size: int) -> Layout:
    """``layout`` must be a :class:`Layout` covering the world; errors name ``arg``."""
    if not isinstance(layout, Layout):
        raise ValueError(f"`{arg}` must be a Layout(dp=..., tp=...), got {layout!r}")
    return layout.check_world(world_size, arg=arg)


class Dispatcher:
    """Moves experience batches between layouts with one all-to-all per dtype.

    ``group``: the process group to dispatch over (default: the world). ``tp_mode``: how a
    destination TP group gets its rows: ``"auto"`` (the plan picks, per group, whatever moves fewer
    bytes through the busiest rank), ``"direct"`` (every member receives them) or ``"broadcast"``
    (one member receives them and broadcasts). ``locality``: let sequences stay on their rank when
    that costs at most 1% balance (``False``: balance as if nothing were anywhere; every byte that
    can move does, as in a full all-to-all reshuffle). After each exchange, ``last_stats`` holds
    ``bytes`` (this rank's bytes sent + received), ``bytes_sent``, ``bytes_recv``,
    ``busiest_rank_bytes``, ``total_bytes`` (all ranks' bytes sent), ``seconds``, ``imbalance``
    (max over mean tokens per destination dp rank), ``num_seqs`` and ``num_tokens`` received.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        tp_mode: TpMode = "auto",
        locality: bool = True,
    ) -> None:
        if tp_mode not in TP_MODES:
            raise ValueError(f"`tp_mode` must be one of {list(TP_MODES)}, got {tp_mode!r}")
        self.group = group
        self.tp_mode = tp_mode
        self.locality = locality
        self.last_stats: dict[str, float] = {}
        self.last_plan: DispatchPlan | None = None
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def exchange(
        self,
        batch: ExperienceBatch,
        to: Layout,
        *,
        src: Layout | None = None,
        keep_groups: bool = False,
    ) -> ExperienceBatch:
        """This rank's share of the batch under layout ``to``.

        ``src`` is the layout that produced ``batch`` (members of one of its TP groups hold
        identical batches); ``None`` means every rank holds its own rows. ``keep_groups`` keeps
        sequences that share a ``group_ids`` value on one dp rank (GRPO groups).
        """
        start = time.perf_counter()
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        to = check_layout(to, "to", world)
        src = check_layout(Layout(dp=world, tp=1) if src is None else src, "src", world)
        batch, lengths, group_ids = gather_metadata(batch, self.group, keep_groups)
        token_bytes, seq_bytes = wire_bytes_per_row(batch.schema())
        plan = make_plan(
            lengths,
            group_ids,
            src=src,
            dst=to,
            token_bytes=token_bytes,
            seq_bytes=seq_bytes,
            keep_groups=keep_groups,
            tp_mode=self.tp_mode,
            locality=self.locality,
        )
        # collective; refuses a group it cannot serve before data moves
        self._create_subgroups(plan)
        received = self._all_to_all(batch, plan, rank)
        received, as_rank = self._tp_broadcast(plan, received, rank, batch.schema())
        out = unpack_received(plan, as_rank, received, batch.schema())
        self.last_plan = plan
        self.last_stats = dispatch_stats(plan, rank, time.perf_counter() - start, out)
        return out

    # -- step 3: the all-to-all ----------------------------------------------------------------
    def _all_to_all(
        self, batch: ExperienceBatch, plan: DispatchPlan, rank: int
    ) -> dict[torch.dtype, torch.Tensor]:
        world = plan.world_size
        chunks = [[plan.src_index[i] for i in plan.rows_from(rank, d)] for d in range(world)]
        packed = pack_chunks(batch, chunks)
        device = comm_device(self.group)
        received = {}
        for dtype, fields in wire_schema(batch.schema()).items():
            buffer, send_sizes = packed[dtype]
            buffer = buffer.to(device)
            recv_sizes = [_elements(plan, fields, plan.rows_from(s, rank)) for s in range(world)]
            out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
            dist.all_to_all_single(out, buffer, recv_sizes, send_sizes, group=self.group)
            received[dtype] = out
        return received

    # -- step 4: broadcast inside destination TP groups ------------------------------------------
    def _tp_broadcast(
        self,
        plan: DispatchPlan,
        received: dict[torch.dtype, torch.Tensor],
        rank: int,
        schema: tuple[FieldSpec, ...],
    ) -> tuple[dict[torch.dtype, torch.Tensor], int]:
        """Members of a broadcast-mode TP group take the root's received buffers (and unpack them
        as the root does, so the group ends with identical batches)."""
        g = plan.dst.coords(rank)[0]
        if plan.tp_mode[g] != "broadcast" or plan.dst.tp == 1:
            return received, rank
        root = plan.root[g]
        members = sorted(broadcast_chain(plan, g))
        pg = self._subgroups[tuple(members)]
        out = {}
        for dtype, fields in wire_schema(schema).items():
            buffer = received[dtype]
            if rank != root:
                size = sum(
                    _elements(plan, fields, plan.rows_from(s, root)) for s in range(plan.world_size)
                )
                buffer = torch.empty(size, dtype=dtype, device=comm_device(self.group))
            dist.broadcast(buffer, group=pg, group_src=members.index(root))
            out[dtype] = buffer
        return out, root

    def _create_subgroups(self, plan: DispatchPlan) -> None:
        """Every rank creates every broadcast group of the plan it has not made yet, in one order.

        ``new_group`` is collective over all processes. Members-only creation
        (``use_local_synchronization``) names a group by its ranks and by how many groups the calling
        rank already has: members that had joined different earlier groups (TP groups in direct mode
        make none) named one group differently and waited for each other in gloo's rendezvous forever.
        """
        if plan.dst.tp == 1:
            return
        for g, mode in enumerate(plan.tp_mode):
            key = tuple(sorted(broadcast_chain(plan, g)))
            if mode != "broadcast" or key in self._subgroups:
                continue
            if self.group is not None and dist.get_world_size(self.group) != dist.get_world_size():
                raise ValueError(
                    f"Dispatcher(group=...): a TP broadcast needs the group to span every process "
                    f"(got {dist.get_world_size(self.group)} of {dist.get_world_size()}); "
                    f"use tp_mode='direct' or the default group"
                )
            global_ranks = [
                dist.get_global_rank(self.group, r) if self.group is not None else r for r in key
            ]
            # the run's collective timeout, not torch's 30 minutes: a silent peer here ends the run in time
            self._subgroups[key] = dist.new_group(global_ranks, timeout=collective_timeout())


def _elements(plan: DispatchPlan, fields: list[FieldSpec], rows: list[int]) -> int:
    return chunk_elements(fields, len(rows), sum(plan.lengths[i] for i in rows))


def unpack_received(
    plan: DispatchPlan,
    receiver: int,
    buffers: dict[torch.dtype, torch.Tensor],
    schema: tuple[FieldSpec, ...],
) -> ExperienceBatch:
    """Unpack what ``receiver`` got in the all-to-all into ascending canonical order."""
    world = plan.world_size
    ids = [i for s in range(world) for i in plan.rows_from(s, receiver)]
    rows_per = [len(plan.rows_from(s, receiver)) for s in range(world)]
    toks_per = [sum(plan.lengths[i] for i in plan.rows_from(s, receiver)) for s in range(world)]
    out = unpack_chunks(buffers, schema, rows_per, toks_per)
    if out.seq_lens.tolist() != [plan.lengths[i] for i in ids]:
        raise RuntimeError(
            "dispatcher: received sequence lengths differ from the plan (ranks disagree on it)"
        )
    order = sorted(range(len(ids)), key=ids.__getitem__)
    # Rows from one sender arrive sorted; several senders (or replicas) interleave canonical ids.
    return out if order == list(range(len(ids))) else out.select(order)


def dispatch_stats(
    plan: DispatchPlan, rank: int, seconds: float, out: ExperienceBatch
) -> dict[str, float]:
    """The figures the training step logs (``dispatch/bytes`` ...), for this rank."""
    return {
        "bytes": float(plan.sent[rank] + plan.recv[rank]),
        "bytes_sent": float(plan.sent[rank]),
        "bytes_recv": float(plan.recv[rank]),
        "busiest_rank_bytes": float(plan.busiest_rank_bytes),
        "total_bytes": float(sum(plan.sent)),
        "seconds": seconds,
        "imbalance": plan.imbalance,
        "num_seqs": float(out.num_seqs),
        "num_tokens": float(out.num_tokens),
    }

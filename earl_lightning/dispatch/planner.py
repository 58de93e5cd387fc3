"""The dispatch plan: who sends which sequence to whom, computed from metadata alone.

Every rank runs :func:`make_plan` on the same all-gathered metadata (per-sequence token counts and
group ids of every rank), so every rank gets the same plan without any further communication.
Pure Python: no torch.distributed, no Lightning.

Identities. In the source layout the members of one tensor-parallel group hold identical batches
(replicas), so a sequence is identified by its *canonical id*: its position when the batches of
the source dp groups are laid end to end (source dp rank, then index in that rank's batch). Every
destination rank ends with its dp group's sequences in ascending canonical order, whichever
replica sent them, so the result is reproducible and identical inside a destination TP group.

Traffic model. ``sent[r]`` / ``recv[r]`` count the bytes rank ``r`` puts on / takes off the
network (a rank's copy to itself is free). Inside a destination TP group the rows either go to
every member directly, or once to a root member that broadcasts them; the broadcast is modelled
as a pipelined chain (what NCCL runs for large messages): the root sends the group's bytes once,
every other member receives them once and all but the last forward them once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from earl_lightning.dispatch.partition import balanced_partition, max_load
from earl_lightning.parallel.layout import Layout

TpMode = Literal["auto", "direct", "broadcast"]
TP_MODES = ("auto", "direct", "broadcast")
# How much larger than the balanced optimum the busiest destination may get when that lets data
# stay where it is: 1% more tokens on one rank costs less than moving most of the batch.
LOCALITY_SLACK = 0.01


@dataclass
class DispatchPlan:
    """Who sends what to whom. Sequences are referred to by canonical id (see module docstring).

    Per canonical sequence ``i``: ``src_dp[i]``, ``src_index[i]`` (its index in the batch of every
    replica of source dp group ``src_dp[i]``), ``lengths[i]`` (tokens), ``group_ids[i]``,
    ``nbytes[i]`` (bytes on the wire) and ``dest_dp[i]`` (the destination dp group).
    ``sends[(a, b)]`` lists, ascending, the sequences rank ``a`` sends to rank ``b`` in the
    all-to-all (``a == b``: a local copy). ``tp_mode[g]`` is ``"direct"`` or ``"broadcast"`` for
    destination dp group ``g``; in broadcast mode only ``root[g]`` receives in the all-to-all.
    """

    src: Layout
    dst: Layout
    src_dp: list[int]
    src_index: list[int]
    lengths: list[int]
    group_ids: list[int]
    nbytes: list[int]
    dest_dp: list[int]
    tp_mode: list[str]
    root: list[int]
    sends: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    sent: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.dst.world_size

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    def rows_of(self, dp_rank: int) -> list[int]:
        """Canonical ids delivered to destination dp group ``dp_rank``, in delivery order."""
        return [i for i, g in enumerate(self.dest_dp) if g == dp_rank]

    def rows_from(self, sender: int, receiver: int) -> list[int]:
        return self.sends.get((sender, receiver), [])

    @property
    def traffic(self) -> list[int]:
        """Bytes through each rank (sent + received over the network)."""
        return [s + r for s, r in zip(self.sent, self.recv)]

    @property
    def busiest_rank_bytes(self) -> int:
        return max(self.traffic, default=0)

    def dp_tokens(self) -> list[int]:
        out = [0] * self.dst.dp
        for g, n in zip(self.dest_dp, self.lengths):
            out[g] += n
        return out

    @property
    def imbalance(self) -> float:
        """Max over mean tokens per destination dp group (1.0 = perfect; 1.0 for an empty batch)."""
        tokens = self.dp_tokens()
        total = sum(tokens)
        return max(tokens) * len(tokens) / total if total else 1.0


# ---- canonical sequences ------------------------------------------------------------------------
def canonical_sequences(
    lengths: list[list[int]], group_ids: list[list[int]], src: Layout
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(src_dp, src_index, lengths, group_ids) per canonical sequence, from per-rank metadata.

    The replicas of a source TP group must report the same batch; a mismatch means ``src`` does
    not describe how the batch is laid out, and is reported rather than silently deduplicated.
    """
    if len(lengths) != src.world_size:
        raise ValueError(
            f"`src` {src.name} covers {src.world_size} ranks, but metadata came from {len(lengths)}"
        )
    out: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    for d in range(src.dp):
        ranks = src.tp_group_ranks(d)
        first = ranks[0]
        for r in ranks[1:]:
            if lengths[r] != lengths[first] or group_ids[r] != group_ids[first]:
                raise ValueError(
                    f"`src` {src.name} says ranks {ranks} are tensor-parallel replicas holding one batch, but "
                    f"rank {first} holds {len(lengths[first])} sequences ({sum(lengths[first])} tokens) and rank "
                    f"{r} holds {len(lengths[r])} ({sum(lengths[r])} tokens); pass the layout that produced the batch"
                )
        for j, (n, gid) in enumerate(zip(lengths[first], group_ids[first])):
            out[0].append(d)
            out[1].append(j)
            out[2].append(n)
            out[3].append(gid)
    return out


def assign_destinations(
    lengths: list[int],
    group_ids: list[int],
    nbytes: list[int],
    src_dp: list[int],
    *,
    src: Layout,
    dst: Layout,
    keep_groups: bool,
    locality: bool = True,
) -> list[int]:
    """Destination dp group per sequence, balancing tokens; whole GRPO groups when ``keep_groups``.

    The balanced partition's parts are matched to destination dp groups so that as many bytes as
    possible are already on a rank of their destination. With ``locality``, a second candidate
    keeps items where they are and moves only the overflow; it wins when its largest group is
    within ``LOCALITY_SLACK`` of the balanced optimum (then an exchange between equal, balanced
    layouts moves almost nothing).
    """
    item_of = _items(group_ids, keep_groups)
    weights = [0] * (max(item_of) + 1 if item_of else 0)
    for i, n in zip(item_of, lengths):
        weights[i] += n
    parts = balanced_partition(weights, dst.dp)
    part_of_seq = [parts[j] for j in item_of]
    mapping = _match_parts_to_groups(part_of_seq, nbytes, src_dp, src=src, dst=dst)
    balanced = [mapping[p] for p in part_of_seq]
    if not locality or dst.dp == 1 or not weights:
        return balanced
    best = max_load(weights, [mapping[p] for p in parts], dst.dp)
    capacity = int(best * (1 + LOCALITY_SLACK))
    homes = _homes(item_of, nbytes, src_dp, len(weights), src=src, dst=dst)
    kept = _home_first(weights, homes, dst.dp, capacity)
    if max_load(weights, kept, dst.dp) > capacity:
        return balanced
    kept = [kept[j] for j in item_of]
    stays = [_local_bytes(dest, nbytes, src_dp, src=src, dst=dst) for dest in (kept, balanced)]
    return kept if stays[0] >= stays[1] else balanced


def _local_bytes(
    dest: list[int], nbytes: list[int], src_dp: list[int], *, src: Layout, dst: Layout
) -> int:
    """Bytes that destination ranks already hold (they need not travel) under ``dest``."""
    return sum(
        b
        for g, b, d in zip(dest, nbytes, src_dp)
        for r in src.tp_group_ranks(d)
        if dst.coords(r)[0] == g
    )


def _items(group_ids: list[int], keep_groups: bool) -> list[int]:
    """Item index of each sequence: the sequence itself, or its GRPO group."""
    if not keep_groups:
        return list(range(len(group_ids)))
    index = {gid: j for j, gid in enumerate(sorted(set(group_ids)))}
    return [index[g] for g in group_ids]


def _homes(
    item_of: list[int],
    nbytes: list[int],
    src_dp: list[int],
    num_items: int,
    *,
    src: Layout,
    dst: Layout,
) -> list[int]:
    """Per item, the destination dp group whose ranks already hold most of its bytes."""
    local: list[dict[int, int]] = [{} for _ in range(num_items)]
    for j, b, d in zip(item_of, nbytes, src_dp):
        for r in src.tp_group_ranks(d):
            g = dst.coords(r)[0]
            local[j][g] = local[j].get(g, 0) + b
    return [min(m, key=lambda g: (-m[g], g)) for m in local]


def _home_first(weights: list[int], homes: list[int], k: int, capacity: int) -> list[int]:
    """Largest items first stay home while their home has room; the rest go, largest first, to
    the lightest group (LPT), so only small items move."""
    loads, parts, rest = [0] * k, [-1] * len(weights), []
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        if loads[homes[i]] + weights[i] <= capacity:
            parts[i] = homes[i]
            loads[homes[i]] += weights[i]
        else:
            rest.append(i)
    heap = [(load, g) for g, load in enumerate(loads)]
    heapq.heapify(heap)
    for i in rest:
        load, g = heapq.heappop(heap)
        parts[i] = g
        heapq.heappush(heap, (load + weights[i], g))
    return parts


def _match_parts_to_groups(
    part_of_seq: list[int], nbytes: list[int], src_dp: list[int], *, src: Layout, dst: Layout
) -> list[int]:
    """Greedy max-overlap matching of partition parts to destination dp groups."""
    overlap: dict[tuple[int, int], int] = {}
    for p, b, d in zip(part_of_seq, nbytes, src_dp):
        for r in src.tp_group_ranks(d):
            key = (p, dst.coords(r)[0])
            overlap[key] = overlap.get(key, 0) + b
    mapping, used = [-1] * dst.dp, set()
    for (p, g), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
        if mapping[p] < 0 and g not in used:
            mapping[p] = g
            used.add(g)
    free = iter(g for g in range(dst.dp) if g not in used)
    return [g if g >= 0 else next(free) for g in mapping]


# ---- routing ------------------------------------------------------------------------------------
def _receivers(plan: DispatchPlan, g: int) -> list[int]:
    """Ranks of destination dp group ``g`` that receive its rows in the all-to-all."""
    return plan.dst.tp_group_ranks(g) if plan.tp_mode[g] == "direct" else [plan.root[g]]


def _choose_roots(plan: DispatchPlan) -> list[int]:
    """Per destination group, the member that already holds the most of the group's bytes."""
    local = [dict.fromkeys(plan.dst.tp_group_ranks(g), 0) for g in range(plan.dst.dp)]
    for i, g in enumerate(plan.dest_dp):
        for r in plan.src.tp_group_ranks(plan.src_dp[i]):
            if r in local[g]:
                local[g][r] += plan.nbytes[i]
    return [min(members, key=lambda r: (-members[r], r)) for members in local]


def _route(plan: DispatchPlan) -> None:
    """Fill ``sends``, ``sent`` and ``recv`` for the plan's destinations and TP modes.

    A rank that holds a replica of a sequence it must receive copies it locally. Otherwise the
    sender is the replica with the least traffic so far, heaviest sequences placed first (LPT).
    """
    w = plan.world_size
    sent, recv = [0] * w, [0] * w
    sends: dict[tuple[int, int], list[int]] = {}
    pending = []
    for i, g in enumerate(plan.dest_dp):
        holders = plan.src.tp_group_ranks(plan.src_dp[i])
        for d in _receivers(plan, g):
            if d in holders:
                sends.setdefault((d, d), []).append(i)
            else:
                recv[d] += plan.nbytes[i]
                pending.append((i, d))
    _add_broadcast_traffic(plan, sent, recv)
    for i, d in sorted(pending, key=lambda p: (-plan.nbytes[p[0]], p)):
        r = min(plan.src.tp_group_ranks(plan.src_dp[i]), key=lambda r: (sent[r] + recv[r], r))
        sent[r] += plan.nbytes[i]
        sends.setdefault((r, d), []).append(i)
    plan.sends = {k: sorted(v) for k, v in sorted(sends.items())}
    plan.sent, plan.recv = sent, recv


def broadcast_chain(plan: DispatchPlan, g: int) -> list[int]:
    """Root first, then the other members of destination group ``g`` in rank order."""
    return [plan.root[g]] + [r for r in plan.dst.tp_group_ranks(g) if r != plan.root[g]]


def _add_broadcast_traffic(plan: DispatchPlan, sent: list[int], recv: list[int]) -> None:
    group_bytes = [0] * plan.dst.dp
    for i, g in enumerate(plan.dest_dp):
        group_bytes[g] += plan.nbytes[i]
    for g, mode in enumerate(plan.tp_mode):
        if mode != "broadcast":
            continue
        chain = broadcast_chain(plan, g)
        for a, b in zip(chain, chain[1:]):
            sent[a] += group_bytes[g]
            recv[b] += group_bytes[g]


def make_plan(
    lengths: list[list[int]],
    group_ids: list[list[int]],
    *,
    src: Layout,
    dst: Layout,
    token_bytes: int,
    seq_bytes: int,
    keep_groups: bool = False,
    tp_mode: TpMode = "auto",
    locality: bool = True,
) -> DispatchPlan:
    """The dispatch plan from every rank's metadata (``lengths[r]``, ``group_ids[r]``: rank ``r``'s
    per-sequence token counts and group ids). ``token_bytes`` / ``seq_bytes``: wire bytes per
    token and per sequence. ``tp_mode="auto"`` starts from direct delivery and switches a
    destination TP group to send-once-and-broadcast whenever that lowers the busiest rank's bytes.
    ``locality=False`` ignores where the data sits when balancing (every byte that can move does).
    """
    if tp_mode not in TP_MODES:
        raise ValueError(f"`tp_mode` must be one of {list(TP_MODES)}, got {tp_mode!r}")
    if src.world_size != dst.world_size:
        raise ValueError(
            f"`src` {src.name} has {src.world_size} ranks but `to` {dst.name} has {dst.world_size}"
        )
    src_dp, src_index, lens, gids = canonical_sequences(lengths, group_ids, src)
    nbytes = [n * token_bytes + seq_bytes for n in lens]
    dest = assign_destinations(
        lens, gids, nbytes, src_dp, src=src, dst=dst, keep_groups=keep_groups, locality=locality
    )
    single = dst.tp == 1
    plan = DispatchPlan(
        src,
        dst,
        src_dp,
        src_index,
        lens,
        gids,
        nbytes,
        dest,
        tp_mode=["direct" if tp_mode == "auto" or single else tp_mode] * dst.dp,
        root=[0] * dst.dp,
    )
    plan.root = _choose_roots(plan)
    _route(plan)
    if tp_mode == "auto" and not single:
        for g in range(dst.dp):
            best = plan.busiest_rank_bytes
            plan.tp_mode[g] = "broadcast"
            _route(plan)
            if plan.busiest_rank_bytes >= best:
                plan.tp_mode[g] = "direct"
                _route(plan)
    return plan

"""Move a model's weights from one parallel layout to another.

Both models have the same architecture and parameter names; each parameter is a DTensor (TP and/or
FSDP2 shards on a mesh) or a plain, fully replicated tensor. On every rank a parameter is one *box*
of the global tensor (an offset and a shape per dim): DTensor placements always cut the global
tensor into boxes that are pairwise either identical (replicas) or disjoint.

- :func:`reshard_naive` (the reference): ``full_tensor()`` every parameter, then slice out the
  destination box. Every rank receives all of every parameter it does not already hold.
- :func:`reshard` (layout-aware): from the boxes alone every rank computes the same plan -- for each
  destination box, which source box covers which part, and which replica sends it -- then moves only
  those slices, bucketed, with one ``all_to_all_single`` per bucket. A slice a rank already holds is
  copied locally and costs nothing, so matching placements (FSDP ``Shard(0)`` vs colwise TP
  ``Shard(0)`` on the same ranks) move zero bytes.

No Lightning import. gloo and NCCL both implement ``all_to_all_single`` with uneven splits for the
float dtypes used here; buckets never mix dtypes, so each bucket is sent in its own dtype.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from earl_lightning.core.checks import check_number

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class ReshardStats:
    """What one reshard cost on this rank. ``bytes_received`` excludes local copies."""

    method: str
    bytes_received: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    num_buckets: int = 0

    def __iadd__(self, other: ReshardStats) -> ReshardStats:
        self.bytes_received += other.bytes_received
        self.bytes_sent += other.bytes_sent
        self.seconds += other.seconds
        self.num_buckets += other.num_buckets
        return self


@dataclass(frozen=True)
class Transfer:
    """Send ``box`` (global coordinates) of parameter ``param`` from rank ``src`` to rank ``dst``."""

    param: int
    src: int
    dst: int
    box: Box


@dataclass
class ReshardPlan:
    """Every rank's transfers, grouped in buckets of consecutive parameters of one dtype."""

    transfers: list[Transfer]
    buckets: list[list[int]] = field(default_factory=list)  # parameter indices per bucket

    def bytes_received(self, rank: int, elem_sizes: list[int]) -> int:
        return sum(
            _volume(t.box) * elem_sizes[t.param]
            for t in self.transfers
            if t.dst == rank and t.src != rank
        )


# ---- boxes (pure) ------------------------------------------------------------------------------


def _volume(box: Box) -> int:
    return math.prod(box[1])


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def box_slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of ``box`` inside a local tensor whose global offset is ``origin``."""
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(box[0], box[1], origin))


def plan_reshard(
    src_boxes: list[list[Box]],
    dst_boxes: list[list[Box]],
    elem_sizes: list[int],
    param_bytes: list[int],
    bucket_bytes: int,
    dtypes: list[str],
) -> ReshardPlan:
    """Deterministic transfer plan from per-rank boxes (``*_boxes[rank][param]``).

    For each destination rank and each distinct source box overlapping what it needs: the rank itself
    when it holds that box (a free local copy), otherwise the replica holder that has sent the fewest
    bytes so far (ties: nearest rank after the destination), which spreads replicated sources over
    their holders instead of making one rank send everything.
    """
    world, num_params = len(src_boxes), len(elem_sizes)
    sent = [0] * world
    transfers: list[Transfer] = []
    for p in range(num_params):
        holders: dict[Box, list[int]] = {}
        for r in range(world):
            if _volume(src_boxes[r][p]):
                holders.setdefault(src_boxes[r][p], []).append(r)
        for dst in range(world):
            need, covered = dst_boxes[dst][p], 0
            for box, ranks in holders.items():
                part = intersect(box, need) if _volume(need) else None
                if part is None:
                    continue
                src = (
                    dst if dst in ranks else min(ranks, key=lambda r: (sent[r], (r - dst) % world))
                )
                if src != dst:
                    sent[src] += _volume(part) * elem_sizes[p]
                transfers.append(Transfer(p, src, dst, part))
                covered += _volume(part)
            if covered != _volume(need):
                raise RuntimeError(
                    f"reshard plan: parameter {p} on rank {dst} is covered {covered}/{_volume(need)} "
                    "elements; source boxes must tile the tensor (identical or disjoint)"
                )
    return ReshardPlan(transfers, _buckets(param_bytes, bucket_bytes, dtypes))


def _buckets(param_bytes: list[int], bucket_bytes: int, dtypes: list[str]) -> list[list[int]]:
    """Consecutive parameters of one dtype up to ``bucket_bytes`` (global size) per bucket."""
    buckets: list[list[int]] = []
    size = 0
    for p, nbytes in enumerate(param_bytes):
        if buckets and dtypes[buckets[-1][-1]] == dtypes[p] and size + nbytes <= bucket_bytes:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


# ---- parameters of a (possibly sharded) model --------------------------------------------------


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def sharded_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, parameter) in a canonical order, every FSDP2 module in its sharded state.

    An FSDP2 module that ran forward with ``reshard_after_forward=False`` (or a forward without
    backward) still exposes its unsharded parameters; resharding first makes the boxes those of the
    layout, which is what the plan was computed for.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return sorted(((_clean_name(n), p) for n, p in model.named_parameters()), key=lambda x: x[0])


def local_tensor(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_box(t: Tensor) -> Box:
    """This rank's box of ``t`` in global coordinates."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return (0,) * t.dim(), tuple(t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _check_same_params(src: list[tuple[str, Tensor]], dst: list[tuple[str, Tensor]]) -> None:
    src_names, dst_names = [n for n, _ in src], [n for n, _ in dst]
    if src_names != dst_names:
        missing = sorted(set(src_names) ^ set(dst_names))[:5]
        raise ValueError(
            f"reshard: source and destination models differ in parameters, e.g. {missing}"
        )
    for (name, s), (_, d) in zip(src, dst):
        if tuple(s.shape) != tuple(d.shape) or s.dtype != d.dtype:
            raise ValueError(
                f"reshard: parameter {name!r} is {tuple(s.shape)} {s.dtype} in the source but "
                f"{tuple(d.shape)} {d.dtype} in the destination"
            )


# ---- the reference path ------------------------------------------------------------------------


@torch.no_grad()
def reshard_naive(src_model: nn.Module, dst_model: nn.Module) -> ReshardStats:
    """Reference: gather every full parameter (``full_tensor()``), keep the destination box."""
    from torch.distributed.tensor import DTensor

    start = time.perf_counter()
    src, dst = sharded_parameters(src_model), sharded_parameters(dst_model)
    _check_same_params(src, dst)
    stats = ReshardStats("naive")
    for (_, s), (_, d) in zip(src, dst):
        full = s.full_tensor() if isinstance(s, DTensor) else s
        stats.bytes_received += (full.numel() - local_tensor(s).numel()) * full.element_size()
        box = local_box(d)
        local_tensor(d).copy_(full[box_slices(box, (0,) * full.dim())])
    stats.seconds = time.perf_counter() - start
    return stats


# ---- the layout-aware path ---------------------------------------------------------------------


class Resharder:
    """Layout-aware reshard between two fixed models; the plan is built once and reused.

    All ranks of the default process group must construct it and call :meth:`run` together.
    """

    def __init__(
        self,
        src_model: nn.Module,
        dst_model: nn.Module,
        *,
        bucket_mb: float = 64.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        check_number("bucket_mb", bucket_mb, low=0, strict=True, unit=" of MiB")
        self.src_model, self.dst_model, self.group = src_model, dst_model, group
        src, dst = sharded_parameters(src_model), sharded_parameters(dst_model)
        _check_same_params(src, dst)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        mine = ([local_box(t) for _, t in src], [local_box(t) for _, t in dst])
        everyone: list = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(everyone, mine, group=group)
        else:
            everyone = [mine]
        self.names = [n for n, _ in src]
        self.elem_sizes = [t.element_size() for _, t in src]
        self.dtypes = [t.dtype for _, t in src]
        self.plan = plan_reshard(
            [e[0] for e in everyone],
            [e[1] for e in everyone],
            self.elem_sizes,
            [t.numel() * t.element_size() for _, t in src],
            int(bucket_mb * 2**20),
            [str(d) for d in self.dtypes],
        )
        self._by_bucket = self._index_transfers()
        # Global, so every rank skips the same collectives (a bucket whose placements coincide).
        moving = {t.param for t in self.plan.transfers if t.src != t.dst}
        self._has_traffic = [any(p in moving for p in ps) for ps in self.plan.buckets]

    def _index_transfers(self) -> list[tuple[list[Transfer], list[Transfer], list[Transfer]]]:
        """Per bucket: (sends to others, receives from others, local copies), in plan order."""
        bucket_of = {p: b for b, ps in enumerate(self.plan.buckets) for p in ps}
        out: list[tuple[list, list, list]] = [([], [], []) for _ in self.plan.buckets]
        for t in self.plan.transfers:
            sends, recvs, local = out[bucket_of[t.param]]
            if t.src == self.rank and t.dst == self.rank:
                local.append(t)
            elif t.src == self.rank:
                sends.append(t)
            elif t.dst == self.rank:
                recvs.append(t)
        return out

    @torch.no_grad()
    def run(self) -> ReshardStats:
        start = time.perf_counter()
        src_params, dst_params = (
            sharded_parameters(self.src_model),
            sharded_parameters(self.dst_model),
        )
        src, dst = (
            [local_tensor(t) for _, t in src_params],
            [local_tensor(t) for _, t in dst_params],
        )
        src_origin = [local_box(t)[0] for _, t in src_params]
        dst_origin = [local_box(t)[0] for _, t in dst_params]
        stats = ReshardStats("layout_aware", num_buckets=len(self.plan.buckets))
        for b, (sends, recvs, local) in enumerate(self._by_bucket):
            for t in local:
                dst[t.param][box_slices(t.box, dst_origin[t.param])].copy_(
                    src[t.param][box_slices(t.box, src_origin[t.param])]
                )
            if self.world > 1 and self._has_traffic[b]:
                got = self._exchange(b, sends, recvs, src, src_origin)
                for t, piece in zip(recvs, got):
                    dst[t.param][box_slices(t.box, dst_origin[t.param])].copy_(piece.view(t.box[1]))
            stats.bytes_sent += sum(_volume(t.box) * self.elem_sizes[t.param] for t in sends)
            stats.bytes_received += sum(_volume(t.box) * self.elem_sizes[t.param] for t in recvs)
        stats.seconds = time.perf_counter() - start
        return stats

    def _exchange(
        self,
        bucket: int,
        sends: list[Transfer],
        recvs: list[Transfer],
        src: list[Tensor],
        src_origin: list[tuple[int, ...]],
    ) -> list[Tensor]:
        """One all_to_all_single for the bucket; returns the received pieces (flat) in ``recvs`` order."""
        dtype = self.dtypes[self.plan.buckets[bucket][0]]
        device = src[self.plan.buckets[bucket][0]].device
        sends = sorted(sends, key=lambda t: t.dst)  # stable: plan order within one destination
        recvs_sorted = sorted(range(len(recvs)), key=lambda i: recvs[i].src)
        in_splits = [sum(_volume(t.box) for t in sends if t.dst == r) for r in range(self.world)]
        out_splits = [sum(_volume(t.box) for t in recvs if t.src == r) for r in range(self.world)]
        pieces = [src[t.param][box_slices(t.box, src_origin[t.param])].reshape(-1) for t in sends]
        send_buf = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        recv_buf = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv_buf, send_buf, out_splits, in_splits, group=self.group)
        out: list[Tensor] = [recv_buf] * len(recvs)
        offset = 0
        for i in recvs_sorted:
            n = _volume(recvs[i].box)
            out[i] = recv_buf[offset : offset + n]
            offset += n
        return out


def reshard(src_model: nn.Module, dst_model: nn.Module, *, bucket_mb: float = 64.0) -> ReshardStats:
    """One-shot layout-aware reshard (builds the plan, then runs it). Cache a :class:`Resharder`
    to reuse the plan across steps."""
    return Resharder(src_model, dst_model, bucket_mb=bucket_mb).run()

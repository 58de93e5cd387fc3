"""The collectives the RL loop needs, in one place: whether a process group is up, and a
:class:`Reducer` over a layout (sum / max / any / agreed count, tensor-parallel replicas counted once).

Under a layout with tensor parallelism the ranks of one TP group hold identical rows (the same
episodes, the same experience), so a sum over ranks must count each TP group once: only TP rank 0
contributes. Maxima and "any" are unaffected by replicas. Every rank must call every reduction
(they are collectives); with one process each is the identity. No Lightning here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from earl_lightning.algorithms.moments import STAT_DTYPE, Moments
from earl_lightning.parallel.layout import Layout


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_elastic_process_group(backend: str, timeout: timedelta, device: torch.device) -> bool:
    """Under torchrun (its agent hosts the store), start the default process group with the keys of
    this restart round under their own prefix; returns whether it did.

    torchrun's workers all connect to the agent's store, which outlives a failed round. A restarted
    round's ranks then can read the dead round's addresses for each other (gloo: "connectFullMesh
    failed ... Connection refused", or a hang in ``init_process_group``; seen in 3 of 6 restarts
    here, 0 of 10 with the prefix). Nothing to do when the group is up or no agent store is used."""
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    kwargs = {} if device.type == "cpu" else {"device_id": device}
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"earl/attempt_{attempt}", base),
        rank=int(os.environ["RANK"]),
        world_size=world,
        timeout=timeout,
        **kwargs,
    )
    return True


_timeout: list[timedelta | None] = [None]  # the last timeout set for the default group


def collective_timeout() -> timedelta | None:
    """The timeout :func:`set_collective_timeout` gave the default group (None: torch's default);
    a group made later (``dist.new_group(..., timeout=collective_timeout())``) takes it too."""
    return _timeout[0]


def set_collective_timeout(
    timeout: timedelta | None, groups: Sequence[dist.ProcessGroup] = ()
) -> None:
    """How long a collective of the default process group (or of ``groups``) waits for a peer
    (None: unchanged).

    Set once the group is up: the group's ``timeout`` also bounds joining it, and a rank that starts
    slowly (imports, a busy machine) would fail a short one. Groups created later (a layout's mesh,
    the dispatcher's broadcast groups) get torch's default timeout unless set here too or made with
    :func:`collective_timeout`."""
    if timeout is not None:
        if not groups:
            _timeout[0] = timeout
        for group in groups or [None]:
            # torch's only setter (private, since 2.2)
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where collective buffers must live: the current CUDA device under NCCL, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` of rank ``src`` on every rank (identity with one process)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Reducer:
    """Reductions over every rank of ``layout`` (default: plain data parallelism, tp = 1).

    ``sum`` counts each TP group once; ``max``, ``any``, ``all`` and ``agree_count`` are over all ranks.
    Results come back on the input's device and dtype.
    """

    def __init__(self, layout: Layout | None = None) -> None:
        if layout is not None:
            layout.check_world(world_size(), arg="layout")
        self.layout = layout

    @property
    def distributed(self) -> bool:
        return is_distributed()

    @property
    def counts_here(self) -> bool:
        """Whether this rank's rows count in a sum (it is TP rank 0 of its group)."""
        return self.layout is None or self.layout.coords(global_rank())[1] == 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, each TP group counted once."""
        if not self.distributed:
            return t
        buf = t.detach().to(comm_device(), copy=True)
        if not self.counts_here:
            buf.zero_()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return buf.to(t.device)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return t
        buf = t.detach().to(comm_device(), copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return buf.to(t.device)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """:meth:`sum` of a list of Python numbers (float64)."""
        return self.sum(torch.tensor(list(values), dtype=torch.float64)).tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return bool(self.max(torch.tensor([1.0 if flag else 0.0]))[0] > 0)

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return not self.any(not flag)

    def agree_count(self, n: int) -> int:
        """The largest ``n`` of any rank: how many lockstep passes every rank must run when
        collectives (FSDP all-gathers, TP reductions) sit inside each pass."""
        return int(self.max(torch.tensor([int(n)], dtype=torch.long))[0])

    def sum_replicated_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum over ranks, in place, the gradients of plain (non-DTensor) parameters such as PPO's
        value head: replicated on every rank and not managed by FSDP, which sums only its own
        sharded ones. TP peers computed identical gradients; each TP group counts once."""
        if not self.distributed:
            return
        for p in params:
            if p.grad is not None and not isinstance(p, DTensor):
                if not self.counts_here:
                    p.grad.zero_()
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def sum_moments(self, parts: Sequence[Moments]) -> list[Moments]:
        """Each of ``parts`` summed over ranks (TP groups once) with ONE all-reduce (float64)."""
        if not self.distributed:
            return list(parts)
        packed = [m.pack().reshape(3, -1) for m in parts]  # [3, numel] each
        flat = self.sum(torch.cat(packed, dim=1).to(STAT_DTYPE))
        out, start = [], 0
        for m, p in zip(parts, packed):
            out.append(Moments.unpack(flat[:, start : start + p.shape[1]].reshape(3, *m.sum.shape)))
            start += p.shape[1]
        return out


def clip_gradients(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Clip all gradients by their global 2-norm; returns that norm.

    Sharded (DTensor) gradients on different meshes (under FSDP x TP the TP-sharded weights live on
    the (dp, tp) mesh, the norms' weights on the dp mesh only) and plain ones (PPO's value head,
    replicated) cannot go through one ``clip_grad_norm_`` call (torch refuses to mix them), so each
    kind's norm is taken on its own and they are combined; with one kind this is ``clip_grad_norm_``."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(
            p
        )
    groups = list(by_mesh.values())
    norms = []
    for g in groups:
        n = torch.nn.utils.get_total_norm([p.grad for p in g], 2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = norms[0] if len(norms) == 1 else torch.stack([n.float().cpu() for n in norms]).norm()
    if max_norm > 0:
        for g, n in zip(groups, norms):
            torch.nn.utils.clip_grads_with_norm_(g, max_norm, total.to(n.device))
    return float(total)

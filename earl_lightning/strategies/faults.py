"""A lost peer in any collective of a run ends it with one line, never a raw traceback.

The RL module's stages and the collectives between them go through a :class:`LostPeer` from
:func:`trainer_lost_peer`; :class:`OneLineCollectives` does the same for a strategy's own
collectives (``barrier``, ``broadcast``, ``reduce``, ``all_gather``), which Lightning's checkpoint
saving, loops and logging call, and, when the run ends so, stops the ranks this process launched;
:class:`OneLineDDPStrategy` is Lightning's DDP with it (``strategy: auto`` on several processes).
"""

from __future__ import annotations

import os
import signal
from contextlib import AbstractContextManager
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from earl_lightning.core.errors import RankFailure
from earl_lightning.core.lightning_internals import (
    PatientLaunch,
    attached_trainer,
    launched_here,
    running_hook,
)
from earl_lightning.parallel.faults import LostPeer, RunFacts


def trainer_lost_peer(trainer: Any, step: str | None = None) -> LostPeer:
    """A :class:`LostPeer` that reads, when a peer is lost, this rank, ``step`` (else the trainer's
    global step), the last checkpoint saved and the run's root directory (not ``trainer.log_dir``:
    reading it is a collective)."""

    def facts() -> RunFacts:
        ckpt = trainer.checkpoint_callback
        return RunFacts(
            rank=trainer.global_rank,
            step=step or f"global step {trainer.global_step}",
            last_checkpoint=ckpt.last_model_path if ckpt is not None else "",
            log_dir=trainer.default_root_dir,
        )

    return LostPeer(facts)


class OneLineCollectives(PatientLaunch):
    """Mixin for a Lightning strategy (first among its bases): a peer lost in one of its
    collectives ends the run with the one-line RankFailure naming the collective and the hook.
    A run that ends with a RankFailure (here or in the module) kills the ranks this process
    started (``earl fit --trainer.devices N``: rank 0 started the others): they are dead or stuck,
    and a stopped one would otherwise live on, holding the terminal's pipes open. Lightning's watch
    over those ranks gives this process time to say so (:class:`PatientLaunch`)."""

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if isinstance(exception, RankFailure) and launched_here(self):
            # a stopped process acts on no other signal until continued
            self.launcher.kill(signal.SIGKILL)

    def _lost_peer(self, what: str) -> AbstractContextManager[None]:
        module = self.lightning_module
        trainer = attached_trainer(module) if module is not None else None
        if trainer is None:  # before the module is attached: set-up
            return LostPeer(lambda: RunFacts(self.global_rank, "set-up", "", os.getcwd())).during(
                what
            )
        hook = running_hook(module)
        return trainer_lost_peer(trainer).during(
            f"the strategy's {what}" + (f" in {hook}" if hook else "")
        )

    @override
    def barrier(self, name: str | None = None) -> None:
        with self._lost_peer(f"barrier {name!r}" if name else "barrier"):
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._lost_peer("broadcast"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lost_peer("reduce"):
            return super().reduce(tensor, *args, **kwargs)

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lost_peer("all_gather"):
            return super().all_gather(tensor, *args, **kwargs)


class OneLineDDPStrategy(OneLineCollectives, DDPStrategy):
    """Lightning's ``DDPStrategy`` (what ``strategy: auto`` or ``ddp`` gives several processes) whose
    collectives end a lost peer in the one line, as EarlStrategy's do."""


def one_line_strategy(strategy: Any, devices: Any, num_nodes: Any) -> Any:
    """The ``strategy`` a Trainer gets from the CLI: ``"ddp"``, or ``"auto"`` over several
    processes (``devices`` > 1 or ``num_nodes`` > 1), becomes :class:`OneLineDDPStrategy`;
    anything else (a strategy instance, another name, one process) is left as it is."""
    count = (
        len(devices)
        if isinstance(devices, (list, tuple))
        else devices
        if isinstance(devices, int)
        else 1
    )
    nodes = num_nodes if isinstance(num_nodes, int) else 1
    if strategy == "ddp" or (strategy in (None, "auto") and (count > 1 or nodes > 1)):
        return OneLineDDPStrategy()
    return strategy

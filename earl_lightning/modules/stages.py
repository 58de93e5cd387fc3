"""Running one RL stage under its layout, retried on an out-of-memory error.

The strategy picks the stage's layout (:class:`~earl_lightning.strategies.stage.StageStrategy`);
on an out-of-memory error, callbacks that are :class:`~earl_lightning.callbacks.base.StageOOMHandler`
(AdaptiveParallelism) may mark that layout infeasible and ask for a retry: the stage then runs
again under the next layout the selector picks, and the step is not lost.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from earl_lightning.callbacks.base import StageOOMHandler
from earl_lightning.errors import EnvironmentFailure, RewardFunctionFailure
from earl_lightning.host_memory import trim_host_memory
from earl_lightning.modules.metrics import StageTimer
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.faults import LostPeer, is_peer_failure
from earl_lightning.parallel.oom import is_oom_error
from earl_lightning.strategies.stage import StageContext, StageStrategy

T = TypeVar("T")


class StageRunner:
    """Runs stages through ``stages`` and asks ``handlers`` what to do on an out-of-memory error.

    ``ask(handler, stage, stats, err)`` calls the handler's hook (the module passes its trainer
    and itself); ``free()`` releases what a failed attempt left behind; ``lost`` turns a
    collective that failed because another rank died or went silent into the one line the run ends
    with, inside a stage and (:meth:`outside`) in the step's collectives between stages.
    """

    def __init__(
        self,
        stages: StageStrategy,
        handlers: Sequence[StageOOMHandler],
        ask: Callable[[StageOOMHandler, str, Mapping[str, Any] | None, BaseException], bool],
        free: Callable[[], None],
        timer: StageTimer,
        lost: LostPeer,
        max_retries: int = 3,
    ) -> None:
        self.stages, self.handlers, self.ask, self.free = stages, list(handlers), ask, free
        self.lost = lost
        self.timer, self.max_retries = timer, max_retries
        self.recoveries = 0

    def outside(self, where: str) -> AbstractContextManager[None]:
        """For the step's collectives between stages (``where``: "the env-failure check")."""
        return self.lost.during(where)

    def run(self, name: str, stats: Mapping[str, Any] | None, fn: Callable[[StageContext], T]) -> T:
        """``fn(ctx)`` under stage ``name``'s layout, retried on an out-of-memory error.

        With several processes, every rank reports after the stage whether it ran out of memory
        (one all-reduce), so that an OOM on one rank is retried by all: safe when the other ranks
        finish the stage without a collective that waits for the failed one (the rollout on
        data-parallel replicas, where the KV cache grows); an OOM before a collective that peers
        are already inside (FSDP's all-gathers in the train stage) still blocks them until the
        process group's timeout."""
        retries = 0
        while True:
            err = out = None
            try:
                with self.stages.stage(name, stats) as ctx, self.timer(name):
                    out = fn(ctx)
            except Exception as e:  # noqa: BLE001 - filtered right below
                if is_peer_failure(e):
                    raise self.lost.error(f"stage {name!r}", e) from e
                if not is_oom_error(e):
                    raise
                err = e
            with self.lost.during(f"stage {name!r}"):
                any_oom = Reducer().any(err is not None)
            if any_oom:
                err = err or MemoryError(f"out of memory in stage {name!r} on another rank")
            elif err is None:
                return out
            if retries >= self.max_retries or not any(
                [self.ask(h, name, stats, err) for h in self.handlers]
            ):
                raise err
            retries += 1
            self.recoveries += 1
            self.free()


def free_memory(optimizers: Sequence[Any], backend: Any) -> None:
    """After a failed attempt: drop gradients and cached generation state, return cached memory
    (the device allocator's and the host heap's)."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if backend is not None:
        backend.release(None)
    gc.collect()
    trim_host_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_env_failures(
    episodes: Sequence[Any], reduce: Reducer, max_share: float, step: int
) -> None:
    """Stop the run when at least ``max_share`` of the step's episodes (over all ranks) failed
    inside their environment, or could not be scored by a reward function (each counted on its
    own, each with its own one-line error). Every rank must call it (one small all-reduce)."""
    env = [ep for ep in episodes if ep.error is not None and ep.error_kind in (None, "env")]
    reward = [ep for ep in episodes if ep.error_kind == "reward"]
    n_env, n_reward, total = reduce.sum_floats(
        [float(len(env)), float(len(reward)), float(len(episodes))]
    )
    share = f"(`--model.rollout.max_failed_share` {max_share:g})"
    if total and n_env / total >= max_share:
        first = (
            f"the first here: {env[0].error}" if env else "see another rank's log for the errors"
        )
        raise EnvironmentFailure(
            f"{int(n_env)} of {int(total)} episodes of RL step {step} failed inside the environment {share}; "
            f"{first}. Fix the environment, or raise max_failed_share to train through failures"
        )
    if total and n_reward / total >= max_share:
        first = (
            reward[0].error if reward else "a reward function failed on another rank; see its log"
        )
        raise RewardFunctionFailure(
            f"{first} ({int(n_reward)} of {int(total)} episodes of RL step {step} could not be scored {share}). "
            f"Fix the reward function, or raise max_failed_share to train on the rows it scores"
        )

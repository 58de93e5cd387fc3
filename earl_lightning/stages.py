"""RL stages: the contract between a strategy and the RL module, and running a stage.

``with stages.stage(name, stats) as ctx:`` runs one RL stage (rollout, experience, train) under
the layout the strategy picked for it. ``ctx`` carries everything the stage needs and nothing
else: the layout, the stage's copy of each model (placed for that layout), a :class:`Reducer`
over the layout (sum / max / any / agreed count, TP replicas counted once) and the layout's
micro-batch budget. :class:`~earl_lightning.strategies.EarlStrategy` implements
:class:`StageStrategy`; under any other Lightning strategy :class:`DataParallelStages` stands in
(every stage plain data parallelism over the world, the module's own models), so the module is
written once.

:class:`StageRunner` runs a stage through that contract and retries it on an out-of-memory error:
callbacks that are :class:`StageOOMHandler` (AdaptiveParallelism) may mark the layout that failed
infeasible and ask for a retry; the stage then runs again under the next layout the selector
picks, and the step is not lost. :class:`StageTimer` times the stages.

Below the strategies, callbacks and modules that share it; no upward import.
"""

from __future__ import annotations

import contextlib
import gc
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn

from earl_lightning.core.errors import EnvironmentFailure, RewardFunctionFailure
from earl_lightning.core.host_memory import trim_host_memory
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.faults import LostPeer, is_peer_failure
from earl_lightning.parallel.layout import Layout, check_stage
from earl_lightning.parallel.oom import is_oom_error


# ---- the contract --------------------------------------------------------------------------
@dataclass(frozen=True)
class StageContext:
    """One running stage: its name, layout, models, reducer and micro-batch budget.

    ``micro_batch_tokens`` is the layout's token budget per forward/backward (the selector
    shrinks it to fit memory), or None when the strategy imposes none.
    """

    name: str
    layout: Layout
    reduce: Reducer
    micro_batch_tokens: int | None
    models: Callable[[str], nn.Module]

    def model(self, attr: str = "policy") -> nn.Module:
        """The model ``attr`` of the LightningModule placed for this stage's layout."""
        return self.models(attr)

    def budget(self, module_tokens: int) -> int:
        """The micro-batch token budget: the module's, lowered to the layout's when it has one."""
        return (
            module_tokens
            if self.micro_batch_tokens is None
            else min(module_tokens, self.micro_batch_tokens)
        )


class StageStrategy(ABC):
    """What a strategy that runs RL stages under their own layouts offers."""

    @abstractmethod
    def stage(
        self, name: str, stats: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[StageContext]:
        """Run stage ``name`` under its layout; ``stats`` (sequences, context lengths) size it."""

    @abstractmethod
    def pop_stage_metrics(self) -> dict[str, float]:
        """Metrics recorded since the last call (layouts, reshard bytes and seconds)."""


class DataParallelStages(StageStrategy):
    """The stand-in under a plain Lightning strategy: data parallelism over ``world_size`` ranks."""

    def __init__(self, module: nn.Module, world_size: int) -> None:
        self.module = module
        self.layout = Layout(dp=world_size, tp=1)

    @contextmanager
    def stage(self, name: str, stats: Mapping[str, Any] | None = None) -> Iterator[StageContext]:
        check_stage(name, arg="stage")
        yield StageContext(name, self.layout, Reducer(self.layout), None, self._model)

    def _model(self, attr: str) -> nn.Module:
        return getattr(self.module, attr)

    def pop_stage_metrics(self) -> dict[str, float]:
        return {}


def stages_of(strategy: Any, module: nn.Module, world_size: int) -> StageStrategy:
    """The trainer's strategy when it runs stages itself, else the data-parallel stand-in."""
    return (
        strategy if isinstance(strategy, StageStrategy) else DataParallelStages(module, world_size)
    )


# ---- running a stage -----------------------------------------------------------------------
class StageOOMHandler(L.Callback):
    """Base of callbacks that recover a stage from an out-of-memory error."""

    def on_stage_oom(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        stage: str,
        stats: Mapping[str, Any] | None,
        err: BaseException,
    ) -> bool:
        """Called on every rank after stage ``stage`` ran out of memory on some rank; return True
        when the stage should run again (e.g. the layout that failed was marked infeasible)."""
        return False


class StageTimer:
    """Wall time per stage, and tokens/s of each stage over the iteration's tokens."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, generated: float, total: float) -> dict[str, float]:
        """``generated`` / ``total``: the iteration's tokens over all ranks."""
        out = {}
        for name, sec in self.seconds.items():
            out[f"stage/{name}/seconds"] = sec
            # rollout throughput counts generated tokens; the other stages process every token
            out[f"stage/{name}/tokens_per_s"] = (generated if name == "rollout" else total) / max(
                sec, 1e-9
            )
        return out


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

    def attempts(self, name: str, stats: Mapping[str, Any] | None) -> Iterator[StageAttempt]:
        """Tries of stage ``name`` until one succeeds on every rank (tenacity's idiom)::

            for attempt in runner.attempts("train", stats):
                with attempt as ctx:
                    ...  # the stage, under ctx.layout

        An out-of-memory error in a try (entering the stage, its body, or leaving it) is kept,
        not raised: with several processes every rank then reports whether it ran out of memory
        (one all-reduce), so that an OOM on one rank is retried by all. That is safe when the
        other ranks finish the stage without a collective that waits for the failed one (the
        rollout on data-parallel replicas, where the KV cache grows); an OOM before a collective
        that peers are already inside (FSDP's all-gathers in the train stage) still blocks them
        until the process group's timeout. The handlers decide whether to try again (under the
        layout the selector picks next) or to raise the error; the body's names keep the values
        of the try that succeeded."""
        retries = 0
        while True:
            attempt = StageAttempt(self, name)
            try:
                with contextlib.ExitStack() as stack:
                    attempt.ctx = stack.enter_context(self.stages.stage(name, stats))
                    stack.enter_context(self.timer(name))
                    attempt.stack = stack.pop_all()
            except Exception as e:  # noqa: BLE001 - classified by keep_oom
                attempt.error = self.keep_oom(name, e)
            if attempt.stack is not None:
                yield attempt
            with self.lost.during(f"stage {name!r}"):
                any_oom = Reducer().any(attempt.error is not None)
            if not any_oom:
                return
            err = attempt.error or MemoryError(f"out of memory in stage {name!r} on another rank")
            if retries >= self.max_retries or not any(
                [self.ask(h, name, stats, err) for h in self.handlers]
            ):
                raise err
            retries += 1
            self.recoveries += 1
            self.free()

    def keep_oom(self, name: str, err: BaseException) -> BaseException:
        """``err`` when it is an out-of-memory error (to retry); a lost peer as its one line;
        anything else raised as it is."""
        if is_peer_failure(err):
            raise self.lost.error(f"stage {name!r}", err) from err
        if not is_oom_error(err):
            raise err
        return err


class StageAttempt:
    """One try of a stage (:meth:`StageRunner.attempts`): ``with attempt as ctx`` runs the body
    under the stage's layout, already entered; leaving closes the stage and keeps an
    out-of-memory error in :attr:`error` instead of raising it."""

    def __init__(self, runner: StageRunner, name: str) -> None:
        self.runner, self.name = runner, name
        self.ctx: StageContext | None = None
        self.stack: contextlib.ExitStack | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> StageContext:
        assert self.ctx is not None, "a StageAttempt is entered once, as attempts() yields it"
        return self.ctx

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        stack, self.stack = self.stack, None
        try:
            if stack is not None and stack.__exit__(exc_type, exc, tb):
                return True
        except Exception as e:  # noqa: BLE001 - leaving the stage failed: classified below
            exc = e
        if exc is None:
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not ours to keep
        self.error = self.runner.keep_oom(self.name, exc)
        return True


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

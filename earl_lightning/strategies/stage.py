"""The stage contract between a strategy and the RL module.

``with stages.stage(name, stats) as ctx:`` runs one RL stage (rollout, experience, train) under
the layout the strategy picked for it. ``ctx`` carries everything the stage needs and nothing
else: the layout, the stage's copy of each model (placed for that layout), a :class:`Reducer`
over the layout (sum / max / any / agreed count, TP replicas counted once) and the layout's
micro-batch budget. :class:`EarlStrategy` implements :class:`StageStrategy`; under any other
Lightning strategy :class:`DataParallelStages` stands in (every stage plain data parallelism over
the world, the module's own models), so the module is written once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.layout import Layout, check_stage


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

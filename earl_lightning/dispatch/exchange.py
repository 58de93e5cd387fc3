"""The DataModule-level exchanger: where every episode and experience row lives.

One object decides placement for the whole RL iteration: which episodes each rank plays in the
rollout (whole GRPO groups per data-parallel rank; TP peers play the same ones), and how the
experience moves between the layouts of consecutive stages (the decentralized dispatcher: one
all-to-all per dtype, planned from metadata alone). :class:`~earl_lightning.modules.datamodule.EpisodeDataModule`
owns one, configured from YAML (``--data.dispatch.*``); the training step only asks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.dispatch.dispatcher import Dispatcher
from earl_lightning.parallel.collectives import world_size
from earl_lightning.parallel.layout import Layout
from earl_lightning.rollout.types import EpisodeSpec


@dataclass(frozen=True)
class DispatchConfig:
    """How experience moves between stage layouts.

    Args:
        keep_groups: keep the rows of one GRPO group on one data-parallel rank (not needed for
            correctness: group statistics are all-reduced; useful for a user's estimator that
            needs a whole group locally).
        tp_mode: how a destination tensor-parallel group gets its rows: ``auto`` (the plan picks
            whatever moves fewer bytes through the busiest rank), ``direct`` (every member
            receives them) or ``broadcast`` (one member receives them and broadcasts).
        locality: let rows stay on their rank when that costs at most 1% of balance (``false``:
            every byte that can move does, a full reshuffle).
    """

    keep_groups: bool = False
    tp_mode: Literal["auto", "direct", "broadcast"] = "auto"
    locality: bool = True

    def __post_init__(self) -> None:
        if self.tp_mode not in ("auto", "direct", "broadcast"):
            raise ValueError(
                f"`--data.dispatch.tp_mode` must be one of ['auto', 'direct', 'broadcast'], "
                f"got {self.tp_mode!r}"
            )
        for name in ("keep_groups", "locality"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"`--data.dispatch.{name}` must be true or false, got {getattr(self, name)!r}"
                )


class Exchanger:
    """Rollout shares and stage-to-stage exchanges; ``pop_metrics()`` gives the step's
    ``dispatch/bytes`` (all ranks' bytes sent), ``dispatch/seconds`` and ``dispatch/imbalance``."""

    def __init__(self, config: DispatchConfig | None = None) -> None:
        self.config = config or DispatchConfig()
        self._dispatcher: Dispatcher | None = None
        self._metrics: dict[str, float] = {}

    @staticmethod
    def rollout_share(specs: list[EpisodeSpec], layout: Layout, rank: int) -> list[EpisodeSpec]:
        """The episodes ``rank`` plays under ``layout``: whole groups, ``group_id % dp == dp_rank``
        (TP peers get the same share and sample in lockstep)."""
        dp_rank = layout.coords(rank)[0]
        return [s for s in specs if s.group_id % layout.dp == dp_rank]

    def exchange(self, batch: ExperienceBatch, *, src: Layout, to: Layout) -> ExperienceBatch:
        """Move ``batch`` from the ranks that produced it under ``src`` to the ranks that consume
        it under ``to``. Between equal layouts it only rebalances tokens across dp ranks (rows
        stay put when the load is already within 1%); a no-op in a single process."""
        if world_size() == 1:
            return batch
        if self._dispatcher is None:
            self._dispatcher = Dispatcher(
                tp_mode=self.config.tp_mode, locality=self.config.locality
            )
        out = self._dispatcher.exchange(batch, to=to, src=src, keep_groups=self.config.keep_groups)
        st, m = self._dispatcher.last_stats, self._metrics
        m["dispatch/bytes"] = m.get("dispatch/bytes", 0.0) + st["total_bytes"]
        m["dispatch/seconds"] = m.get("dispatch/seconds", 0.0) + st["seconds"]
        m["dispatch/imbalance"] = max(m.get("dispatch/imbalance", 0.0), st["imbalance"])
        return out

    def pop_metrics(self) -> dict[str, float]:
        """The dispatch figures summed over this step's exchanges, then cleared."""
        out, self._metrics = self._metrics, {}
        return out

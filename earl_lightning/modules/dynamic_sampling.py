"""DAPO's dynamic sampling (Yu et al., 2025): a group whose rewards are all equal gets advantage 0
under GRPO and RLOO and teaches nothing, so it is dropped and more groups are drawn until the
batch holds ``batch_size / group_size`` groups with spread, within ``max_draws`` draws.

The DataModule offers the draws: draw 0 is the step's batch, draw ``k`` is
``EpisodeDataModule.extra_batch(step, k)``, a pure function of ``(seed, step, k)`` (a resumed run
draws the same). :func:`play_draws` plays them through the caller's ``play``; :class:`Draws` keeps
what they played and decides which groups make the batch. After each draw one all-reduce of the
groups' reward moments (TP peers counted once) tells every rank which groups have spread, so every
rank takes the same decisions: how many draws, and which groups train, renumbered ``0..n-1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from earl_lightning.algorithms.moments import STAT_DTYPE, Moments, grouped_moments
from earl_lightning.rollout.types import Episode, EpisodeSpec

MomentsReduce = Callable[[Sequence[Moments]], list[Moments]]


def spread_groups(
    episodes: Sequence[Episode], num_groups: int, reduce: MomentsReduce
) -> list[bool]:
    """Per group id of the step: whether its rewards (over every rank) differ, i.e. whether a
    group-relative estimator gives it a signal (a group of fewer than two has none)."""
    rewards = torch.tensor([float(ep.reward) for ep in episodes], dtype=STAT_DTYPE)
    ids = torch.tensor([ep.spec.group_id for ep in episodes], dtype=torch.long)
    (group,) = reduce([grouped_moments(rewards, ids, num_groups)])
    flat = group.var() <= 1e-12 * (1.0 + group.mean().abs())
    return ((group.count >= 2) & ~flat).tolist()


class Draws:
    """The draws of one step: this rank's episodes of each and every group's spread."""

    def __init__(self, num_groups: int, group_size: int, max_draws: int) -> None:
        self.num_groups, self.group_size, self.max_draws = num_groups, group_size, max_draws
        self._episodes: list[list[Episode]] = []
        self._spread: list[list[bool]] = []

    def add(self, episodes: list[Episode], reduce: MomentsReduce) -> bool:
        """Record a draw (a collective unless dynamic sampling is off); whether to draw again."""
        self._episodes.append(episodes)
        if self.max_draws == 1:
            return False
        self._spread.append(spread_groups(episodes, self.num_groups, reduce))
        return self.with_spread < self.num_groups and len(self._episodes) < self.max_draws

    @property
    def count(self) -> int:
        return len(self._episodes)

    @property
    def with_spread(self) -> int:
        return sum(sum(flags) for flags in self._spread)

    @property
    def first(self) -> list[Episode]:
        """The step's own batch (draw 0): what the step's episode metrics describe."""
        return self._episodes[0]

    @property
    def played(self) -> list[Episode]:
        """Every episode this rank played in the step's draws."""
        return [ep for eps in self._episodes for ep in eps]

    def batch(self) -> list[Episode]:
        """This rank's episodes of the groups that train: the first ``num_groups`` with spread in
        draw order, filled up at the cap with the zero-spread ones drawn first; each group
        renumbered by its place in the batch."""
        if self.max_draws == 1:
            return self.first
        order = [(d, g) for d, flags in enumerate(self._spread) for g in range(self.num_groups)]
        spread = [(d, g) for d, g in order if self._spread[d][g]]
        flat = [(d, g) for d, g in order if not self._spread[d][g]]
        chosen = (spread + flat)[: self.num_groups]
        place = {key: i for i, key in enumerate(sorted(chosen))}
        out = []
        for d, eps in enumerate(self._episodes):
            for ep in eps:
                new = place.get((d, ep.spec.group_id))
                if new is not None:
                    out.append(self._renumbered(ep, new))
        return out

    def _renumbered(self, ep: Episode, group: int) -> Episode:
        member = ep.spec.episode_id - ep.spec.group_id * self.group_size
        spec = replace(ep.spec, group_id=group, episode_id=group * self.group_size + member)
        return replace(ep, spec=spec)

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/draws``, ``groups_drawn`` and ``groups_dropped`` (zero-spread groups
        left out); nothing when dynamic sampling is off."""
        if self.max_draws == 1:
            return {}
        drawn = self.count * self.num_groups
        return {
            "dynamic_sampling/draws": float(self.count),
            "dynamic_sampling/groups_drawn": float(drawn),
            "dynamic_sampling/groups_dropped": float(drawn - self.num_groups),
        }


def play_draws(
    play: Callable[[list[EpisodeSpec], int], list[Episode]],
    first: list[EpisodeSpec],
    extra: Callable[[int], list[EpisodeSpec]],
    draws: Draws,
    reduce: MomentsReduce,
) -> Draws:
    """Play the step's batch (``play(specs, 0)``), then draw ``k = 1, 2, ...`` (``play(extra(k), k)``)
    while :meth:`Draws.add` asks for more."""
    episodes = play(first, 0)
    while draws.add(episodes, reduce):
        episodes = play(extra(draws.count), draws.count)
    return draws

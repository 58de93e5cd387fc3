"""Dynamic sampling on 2 processes: each rank plays only its own groups, yet every rank takes the
same number of draws and the same groups, renumbered alike, as one process does; under tp=2 the
replicas' groups count once."""

from __future__ import annotations

import pytest

from earl_lightning.modules.dynamic_sampling import Draws, play_draws
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.parallel.layout import Layout
from earl_lightning.rollout.types import Episode, EpisodeSpec
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed

GROUPS, G, MAX_DRAWS = 6, 3, 4
# per draw, the groups whose rewards differ (the others: all equal); 2 + 1 + 2 = 5 < 6 after three
# draws, full in the fourth
SPREAD = [{0, 3}, {4}, {1, 5}, {0, 1, 2, 3, 4, 5}]


def draw(k: int) -> list[Episode]:
    out = []
    for g in range(GROUPS):
        for m in range(G):
            reward = float(m) if g in SPREAD[k] else 0.5
            spec = EpisodeSpec("recall", seed=100 * k + g, group_id=g, episode_id=g * G + m)
            out.append(
                Episode(spec, [1], [1], [0.0], reward, 1, True, False, False, None, None, [0], [])
            )
    return out


def play_share(layout: Layout, rank: int) -> tuple[int, list[tuple[int, int, int]]]:
    dp_rank = layout.coords(rank)[0]
    mine = lambda k: [ep for ep in draw(k) if ep.spec.group_id % layout.dp == dp_rank]  # noqa: E731
    draws = Draws(GROUPS, G, MAX_DRAWS)
    play_draws(lambda specs, k: mine(k), None, lambda k: None, draws, Reducer(layout).sum_moments)
    return draws.count, [(e.spec.seed, e.spec.group_id, e.spec.episode_id) for e in draws.batch()]


def _ranks(rank: int, world: int, dp: int, tp: int):
    return play_share(Layout(dp=dp, tp=tp), rank)


@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_ranks_agree_with_one_process(dp, tp):
    count, reference = play_share(Layout(), 0)
    assert count == 4 and len(reference) == GROUPS * G
    assert sorted({seed for seed, _, _ in reference}) == [0, 3, 104, 201, 205, 300]
    results = run_distributed(_ranks, 2, dp, tp)
    assert [c for c, _ in results] == [4, 4]
    if tp == 2:  # replicas: the same groups, each counted once in the decision
        assert results[0][1] == results[1][1] == reference
    else:
        assert sorted(results[0][1] + results[1][1]) == sorted(reference)

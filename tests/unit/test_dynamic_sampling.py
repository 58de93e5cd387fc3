"""Dynamic sampling (``algorithm.dynamic_sampling.max_draws``): which groups make the batch, how
they are renumbered, the draws the DataModule offers (a pure function of seed, step and draw), and
the settings' errors. The resume through the `earl` command: tests/e2e/test_dynamic_sampling.py."""

from __future__ import annotations

import datasets
import pytest

from earl_lightning.modules.algorithm_groups import DynamicSamplingConfig, check_draws
from earl_lightning.modules.config import AlgorithmConfig
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.dynamic_sampling import Draws, play_draws
from earl_lightning.rollout.types import Episode, EpisodeSpec

G = 2  # episodes per group


def local(parts):  # one process: the reduction is the identity
    return list(parts)


def _episodes(draw: int, rewards: list[tuple[float, float]]) -> list[Episode]:
    """A draw's groups (one (reward, reward) pair each), members ``g * G + m``."""
    out = []
    for g, pair in enumerate(rewards):
        for m, r in enumerate(pair):
            spec = EpisodeSpec("recall", seed=100 * draw + g, group_id=g, episode_id=g * G + m)
            out.append(
                Episode(spec, [1], [1], [0.0], r, 1, True, False, False, None, None, [0], [])
            )
    return out


SPREAD, FLAT = (1.0, 0.0), (0.5, 0.5)


def test_zero_spread_groups_are_replaced_from_the_next_draws():
    draws = Draws(num_groups=4, group_size=G, max_draws=3)
    plays = {
        0: _episodes(0, [SPREAD, FLAT, SPREAD, FLAT]),
        1: _episodes(1, [FLAT, SPREAD, FLAT, SPREAD]),
    }
    asked = []

    def play(specs, k):
        asked.append((specs, k))
        return plays[k]

    play_draws(play, "first", lambda k: f"extra {k}", draws, local)
    assert asked == [("first", 0), ("extra 1", 1)]  # full after two draws: no third
    batch = draws.batch()
    # draw 0's groups 0 and 2, then draw 1's groups 1 and 3, renumbered in that order
    assert [(ep.spec.seed, ep.spec.group_id, ep.spec.episode_id) for ep in batch] == [
        (0, 0, 0), (0, 0, 1), (2, 1, 2), (2, 1, 3), (101, 2, 4), (101, 2, 5), (103, 3, 6), (103, 3, 7)
    ]  # fmt: skip
    assert draws.metrics() == {
        "dynamic_sampling/draws": 2.0,
        "dynamic_sampling/groups_drawn": 8.0,
        "dynamic_sampling/groups_dropped": 4.0,
    }
    assert draws.first is plays[0] and len(draws.played) == 16


def test_at_the_cap_the_batch_is_filled_with_the_first_zero_spread_groups():
    draws = Draws(num_groups=3, group_size=G, max_draws=2)
    plays = {0: _episodes(0, [FLAT, SPREAD, FLAT]), 1: _episodes(1, [FLAT, FLAT, FLAT])}
    play_draws(lambda specs, k: plays[k], "first", lambda k: k, draws, local)
    assert draws.count == 2
    # the group with spread, then draw 0's flat groups 0 and 2: in (draw, group) order
    assert [(ep.spec.seed, ep.spec.group_id) for ep in draws.batch()] == [
        (0, 0), (0, 0), (1, 1), (1, 1), (2, 2), (2, 2)
    ]  # fmt: skip
    assert draws.metrics()["dynamic_sampling/groups_dropped"] == 3.0


def test_off_plays_once_and_keeps_the_batch_as_drawn():
    def no_reduce(parts):
        raise AssertionError("no collective when dynamic sampling is off")

    draws = Draws(num_groups=2, group_size=G, max_draws=1)
    first = _episodes(0, [FLAT, FLAT])
    play_draws(lambda specs, k: first, "first", lambda k: k, draws, no_reduce)
    assert draws.batch() is first and draws.metrics() == {} and draws.count == 1


def test_extra_draws_are_a_pure_function_of_seed_step_and_draw():
    rows = datasets.Dataset.from_list(
        [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    )
    kw = dict(
        dataset=rows, reward_funcs=["tests.plugins.rewards.exact_sum"], batch_size=8, group_size=4
    )
    a, b = EpisodeDataModule(seed=3, **kw), EpisodeDataModule(seed=3, **kw)
    prompts = lambda specs: [s.row["prompt"] for s in specs]  # noqa: E731
    assert prompts(a.extra_batch(5, 1)) == prompts(b.extra_batch(5, 1))  # a resumed run's
    own, one, two = a._stream(0).batch(5), a.extra_batch(5, 1), a.extra_batch(5, 2)
    assert len({tuple(prompts(own)), tuple(prompts(one)), tuple(prompts(two))}) == 3
    assert [s.group_id for s in one] == [s.group_id for s in own]
    assert [s.episode_id for s in one] == [s.episode_id for s in own]
    games = EpisodeDataModule(env="connect_four", seed=3, batch_size=4, group_size=2)
    seeds = {s.seed for s in games._stream(0).batch(0)} | {s.seed for s in games.extra_batch(0, 1)}
    assert len(seeds) == 4 and min(seeds) >= games.eval_episodes  # never an evaluation seed
    with pytest.raises(ValueError, match=r"`k` must be a positive integer, got 0"):
        a.extra_batch(5, 0)


def test_settings_errors_name_the_flag():
    with pytest.raises(
        ValueError,
        match=r"`--model.algorithm.dynamic_sampling.max_draws` must be a positive integer, got 0",
    ):
        AlgorithmConfig(dynamic_sampling={"max_draws": 0})
    with pytest.raises(
        ValueError,
        match=r"`--model.algorithm.dynamic_sampling.max_draws` 4 drops the groups whose rewards are "
        r"all equal, and with `--data.group_size` 1 every group is one episode",
    ):
        check_draws(DynamicSamplingConfig(max_draws=4), 1)
    check_draws(DynamicSamplingConfig(max_draws=1), 1)

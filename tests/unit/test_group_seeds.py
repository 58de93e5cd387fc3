"""What the members of a training group share: ``--data.group_seeds shared | distinct``."""

from __future__ import annotations

import pytest

from earl_lightning.envs.base import make_env
from earl_lightning.modules.datamodule import EpisodeDataModule, EpisodeStream


def _batches(group_seeds: str, steps: int = 3, batch: int = 16, group: int = 8, seed: int = 1):
    stream = EpisodeStream(
        "connect_four", {"opponent": "random"}, batch, group, seed, 0, group_seeds
    )
    return [stream.batch(step) for step in range(steps)]


def test_shared_members_play_their_groups_seed():
    for specs in _batches("shared"):
        for g in {s.group_id for s in specs}:
            assert len({s.seed for s in specs if s.group_id == g}) == 1


def test_distinct_seeds_are_unique_keep_parity_and_avoid_eval_seeds():
    shared, distinct = _batches("shared", steps=50), _batches("distinct", steps=50)
    seeds = [s.seed for specs in distinct for s in specs]
    assert len(seeds) == len(set(seeds)) == 50 * 16
    assert min(seeds) > 1_000_000  # eval plays seeds 0..eval_episodes-1
    for a, b in zip(
        (s for specs in shared for s in specs), (s for specs in distinct for s in specs)
    ):
        assert (a.group_id, a.episode_id) == (b.group_id, b.episode_id)
        assert a.seed % 2 == b.seed % 2  # the seat of `seat: alternate` is the group's


def test_distinct_members_share_the_seat_and_start_but_not_the_opponents_moves():
    """Every member of a Connect Four group plays the same seat (and, moving first, from the same
    empty board); when all play the same columns, their opponents' replies differ."""
    env = make_env("connect_four", opponent="random", seat="alternate")
    specs = _batches("distinct", steps=1)[0]
    for g in (0, 1):
        members = [s for s in specs if s.group_id == g]
        firsts = [env.reset(s.seed) for s in members]
        assert len({f.splitlines()[0][:10] for f in firsts}) == 1  # "You are x." / "You are o."
        if firsts[0].startswith("You are x"):
            assert len(set(firsts)) == 1  # moving first: one starting board
        games = set()
        for s in members:
            env.reset(s.seed)
            seen = []
            for action in ("3", "3", "2"):
                result = env.step(action)
                seen.append(result.observation)
                if result.done:
                    break
            games.add(tuple(seen))
        assert len(games) > 1


def test_same_stream_from_a_resumed_step():
    stream = EpisodeStream("connect_four", {}, 16, 8, 0, 0, "distinct")
    resumed = EpisodeStream("connect_four", {}, 16, 8, 0, 5, "distinct")
    assert next(iter(resumed))["specs"] == stream.batch(5)


def test_unknown_group_seeds_names_the_argument():
    with pytest.raises(
        ValueError,
        match=r"`--data.group_seeds` must be one of \['shared', 'distinct'\], got 'per_member'",
    ):
        EpisodeDataModule(group_seeds="per_member")

"""The chaos run's faults (``scripts/chaos_plugins.py``): the environment faults are a pure
function of the episode seed (so a run without the other faults is the chaos run's reference),
each fault fires where it was drawn, and the once-only faults fire once."""

from __future__ import annotations

import time

import pytest

from tests.load import load_repo_file

chaos = load_repo_file("scripts/chaos_plugins.py", "chaos_plugins")
CONNECT4 = {"opponent": "random", "seat": "alternate"}


def draws(env, seeds) -> list:
    out = []
    for seed in seeds:
        env.reset(seed)
        out.append((env.fault, env.fault_turn))
    return out


def test_env_faults_are_a_function_of_the_seed():
    a, b = (chaos.FlakyEnv(inner_kwargs=CONNECT4, raise_p=0.2, hang_p=0.1) for _ in range(2))
    seeds = list(range(200))
    first = draws(a, seeds)
    assert first == draws(b, reversed(seeds))[::-1] == draws(a, seeds)
    kinds = [fault for fault, _ in first]
    assert 20 <= kinds.count("raise") <= 60 and 5 <= kinds.count("hang") <= 35


def test_a_raising_episode_raises_at_its_drawn_turn_only():
    env = chaos.FlakyEnv(inner_kwargs=CONNECT4, raise_p=1.0, max_turn=2)
    env.reset(5)
    for _ in range(env.fault_turn):
        assert not env.step("3").done
    with pytest.raises(RuntimeError, match=f"seeded env failure at turn {env.fault_turn}"):
        env.step("3")


def test_a_hanging_episode_sleeps_past_the_timeout_once():
    env = chaos.FlakyEnv(inner_kwargs=CONNECT4, raise_p=0.0, hang_p=1.0, hang_s=0.3, max_turn=0)
    env.reset(1)
    start = time.monotonic()
    env.step("3")
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    env.step("3")
    assert time.monotonic() - start < 0.3


def test_once_only_markers(tmp_path):
    marker = str(tmp_path / "m")
    assert chaos._once(marker) and not chaos._once(marker)

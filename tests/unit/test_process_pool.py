"""The pool of worker processes behind ``call_isolation: process``: bounded, started once and reused
across rollouts, light (no CLI, Lightning or torch in a worker), a call that holds the GIL killed at
the time limit with only its episode lost (the others of its worker rebuilt by replay, or failed in
one line when their env is not a function of its seed and calls), and no process left behind."""

from __future__ import annotations

import os
import re
import time

import pytest

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, SamplingConfig, rollout
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.env_calls import EnvCalls
from earl_lightning.rollout.process_env import (
    ProcessEnv,
    pool_size,
    release_pool,
    shutdown_workers,
    worker_pool,
)
from earl_lightning.tasks.tools import resolve_tools
from tests.plugins.scripted import Says
from tests.plugins.workers import alive

WHERE = "tests.plugins.workers.Where"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(make_tiny_model("earl-tiny")))


@pytest.fixture
def fresh_pool():
    """No pool yet (the next rollout starts one), and none left after the test."""
    shutdown_workers()
    yield
    shutdown_workers()


def play(tok, n: int, timeout_s: float, first: int = 0, env: str = WHERE, **env_kwargs):
    specs = [
        EpisodeSpec(env, seed=s, group_id=s, episode_id=s, env_kwargs=env_kwargs)
        for s in range(first, first + n)
    ]
    backend = PolicyBackend({s.episode_id: Says("hi") for s in specs}, tok)
    return rollout(
        specs,
        backend,
        tok,
        SamplingConfig(max_new_tokens=8),
        max_turns=2,
        max_context_tokens=1024,
        env_timeout_s=timeout_s,
        call_workers=2,
        call_isolation="process",
    )


def test_a_call_that_holds_the_gil_is_killed_and_the_pool_recovers(tok, fresh_pool):
    """Five episodes on two workers; one step computes 10**10**8 (minutes in one C call, the GIL
    held): its worker is killed at the time limit, its episode alone fails, the episodes that lived
    in the same worker are rebuilt in its replacement, and the next rollout plays on the same pool."""
    size = pool_size(2)
    pool = worker_pool(pool_size(2))
    first_pids = pool.pids()
    release_pool(pool)
    t0 = time.perf_counter()
    episodes = play(tok, 5, timeout_s=2.0, hang_seed=0)
    assert time.perf_counter() - t0 < 30.0
    assert episodes[0].error == (
        f"env {WHERE!r} (seed 0): step() did not return within env_timeout_s=2s; its worker "
        f"process is killed"
    )
    assert [(e.error, e.reward) for e in episodes[1:]] == [(None, 1.0)] * 4
    played = {e.info["pid"] for e in episodes[1:]}
    assert not any(alive(p) for p in set(first_pids) - set(pool.pids()))  # the killed one is gone
    assert len(set(first_pids) - set(pool.pids())) == 1 and played <= set(pool.pids()) | set(
        first_pids
    )
    assert os.getpid() not in played

    again = play(tok, 5, timeout_s=2.0, first=5)  # the next step: the same pool, no new process
    assert [(e.error, e.reward) for e in again] == [(None, 1.0)] * 5
    assert {e.info["pid"] for e in again} <= set(pool.pids()) and len(pool.pids()) == size


def test_an_episode_that_cannot_be_replayed_fails_in_one_line(tok, fresh_pool):
    """An env whose reset is not a function of its seed cannot be moved to a fresh worker: the
    episodes that shared the killed worker fail, naming the call whose answer changed."""
    episodes = play(tok, 4, timeout_s=2.0, hang_seed=0, noisy=True)
    moved = [e for e in episodes[1:] if e.error is not None]
    assert pool_size(2) == 1 or len(moved) == 1, [e.error for e in episodes]
    for e in moved:
        assert re.fullmatch(
            rf"env {re.escape(repr(WHERE))} \(seed {e.spec.seed}\): step\(\) raised EnvMoved\(\"its "
            r"worker process ended \(another call there ran past the time limit, or crashed\), and "
            r"replaying its calls \(1\) in a fresh one gave another answer to call 1 \(reset\): "
            r"'Say something \(0\.\d+\)\.' instead of 'Say something \(0\.\d+\)\.'; an environment "
            r"is moved only when it is a function of its seed and calls\"\)",
            e.error,
        ), e.error


def test_start_up_is_paid_once_and_not_counted_in_a_call_s_time(tok, fresh_pool):
    """A time limit shorter than a worker's start-up: the first rollout's calls still return in
    time (the pool started before any call was timed), and every rollout uses the same workers."""
    pids = [{e.info["pid"] for e in play(tok, 4, timeout_s=0.75, first=4 * i)} for i in range(3)]
    assert all(p <= pids[0] for p in pids[1:]) and len(pids[0]) <= pool_size(2)


def test_a_fresh_workers_import_of_the_env_module_is_not_counted_in_a_call_s_time(tok, fresh_pool):
    """The environment's module takes 1.5 s to import, twice the time limit: each worker imports it
    before the limit of the episode's first call starts, so every episode plays (its reset was
    timed out before, the import counted in it: the chaos run's first failure)."""
    episodes = play(tok, 4, timeout_s=0.75, env="tests.plugins.slow_import.SlowImportWhere")
    assert [(e.error, e.reward) for e in episodes] == [(None, 1.0)] * 4


def test_a_worker_imports_neither_the_cli_nor_lightning_nor_torch(fresh_pool):
    (tool,) = resolve_tools(["tests.plugins.workers.heavy_modules"])
    pool = worker_pool(1)
    env = ProcessEnv(pool, None, {}, [tool])
    try:
        assert env.hosted()[0].fn() == "none"
    finally:
        env.close()
        release_pool(pool)


def test_shutdown_ends_and_reaps_every_worker(fresh_pool):
    pool = worker_pool(pool_size(2))
    pids = pool.pids()
    release_pool(pool)
    assert all(alive(p) for p in pids)
    shutdown_workers()
    assert not any(alive(p) for p in pids)


def test_the_pool_size_is_the_cpus_the_call_workers_or_as_given(fresh_pool):
    calls = EnvCalls(isolation="process", workers=2, processes=3)
    try:
        assert calls._workers.size == 3 and len(calls._workers.pids()) == 3
    finally:
        calls.close()
    assert pool_size(64) == min(64, len(os.sched_getaffinity(0))) and pool_size(1) == 1
    with pytest.raises(
        ValueError, match=r"^`call_processes` must be a positive integer or None, got 0$"
    ):
        EnvCalls(isolation="process", processes=0)

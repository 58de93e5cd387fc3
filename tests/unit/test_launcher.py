"""The test launcher (tests/distributed/launch.py) never hangs: a rank that dies without reporting
fails `run_distributed` within seconds, naming the rank and how it died, and a rank left waiting
for the dead one is killed; a group that never forms is launched once more, and a second hang fails."""

import os
import signal
import time

import pytest

from tests.distributed.launch import STALL_ENV, run_distributed

# Spawning two processes that import torch and join a gloo group takes a few seconds on a loaded
# machine; a hang would take the whole `timeout` (300 s by default).
BOUND_S = 60


def _rank1_exits(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(600)  # rank 0 waits, as a rank blocked in a collective with a dead peer would


def _rank1_killed(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def _both_hang(rank, world_size):
    time.sleep(600)


def _returns(rank, world_size, offset):
    return rank + offset


def _raises(rank, world_size):
    if rank == 0:
        raise KeyError("boom on rank 0")
    return rank


@pytest.mark.parametrize(
    "fn, how", [(_rank1_exits, r"exit code 3"), (_rank1_killed, r"killed by signal SIGKILL")]
)
def test_a_rank_that_dies_without_reporting_fails_the_launch_quickly(fn, how):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 died without reporting a result \({how}\)"):
        run_distributed(fn, 2)
    assert time.monotonic() - start < BOUND_S


def test_ranks_that_never_report_fail_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no result from rank\(s\) \[0, 1\] within 8 s"):
        run_distributed(_both_hang, 2, timeout=8)
    assert time.monotonic() - start < 8 + BOUND_S


def test_an_exception_on_a_rank_fails_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 0:.*KeyError: 'boom on rank 0'"):
        run_distributed(_raises, 2)


def test_a_normal_run_returns_every_rank_in_order():
    assert run_distributed(_returns, 2, 10) == [10, 11]


def test_a_group_that_never_forms_is_launched_once_more(tmp_path, monkeypatch):
    # Rank 0 of the first launch never joins (as when gloo's rendezvous hangs); the second forms.
    marker = tmp_path / "stalled"
    monkeypatch.setenv(STALL_ENV, f"{marker}:1")
    start = time.monotonic()
    assert run_distributed(_returns, 2, 5, join_timeout=10) == [5, 6]
    assert marker.read_text() == "stalled\n" and time.monotonic() - start < 10 + BOUND_S


def test_a_group_a_rank_failed_to_join_is_launched_once_more(tmp_path, monkeypatch):
    # Rank 0's first join fails (as when another job's rank reached the store's port first).
    marker = tmp_path / "failed"
    monkeypatch.setenv(STALL_ENV, f"{marker}:1:fail")
    assert run_distributed(_returns, 2, 5, join_timeout=30) == [5, 6]
    assert marker.read_text() == "stalled\n"


def test_a_group_that_never_forms_twice_fails_naming_the_ranks(tmp_path, monkeypatch):
    # rank 1 waits in the rendezvous for rank 0: neither is in the group
    monkeypatch.setenv(STALL_ENV, f"{tmp_path / 'stalled'}:2")
    with pytest.raises(
        RuntimeError,
        match=r"the gloo group did not form, twice \(rank\(s\) \[0, 1\] not in the process "
        r"group after 6 s; then rank\(s\) \[0, 1\] not in the process group after 6 s\)",
    ):
        run_distributed(_returns, 2, 5, join_timeout=6)

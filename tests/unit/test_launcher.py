"""The test launcher (tests/distributed/launch.py) never hangs: a rank that dies without reporting
fails `run_distributed` within seconds, naming the rank and how it died, and a rank left waiting
for the dead one is killed."""

import os
import signal
import time

import pytest

from tests.distributed.launch import run_distributed

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


@pytest.mark.parametrize("fn, how", [(_rank1_exits, r"exit code 3"), (_rank1_killed, r"killed by signal SIGKILL")])
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

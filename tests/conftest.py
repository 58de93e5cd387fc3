"""Shared test set-up."""

import os
import sys

# One intra-op thread in every process the suite runs, unless the caller's environment says
# otherwise: this process's in-process runs (`main([...])`, the Python API), the fork server of
# tests/distributed/launch.py and what forks from it, and every subprocess (they inherit it).
# CI runs two workers on two cores; torch's default of a thread per core then keeps four threads
# on two cores, and OpenMP's waiting threads spin on cores the other worker needs (one of
# tests/e2e/test_algorithms.py's fits: 1.0 s of CPU on one thread, 2.3-6.5 s on two, same losses,
# on the shared machine). Lightning gives each rank of `--trainer.devices 2` one thread already.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _argv_of_the_earl_command(monkeypatch):
    # Tests run the `earl` command in-process with `main([...])`; LightningCLI warns when it also
    # sees pytest's own arguments in sys.argv, so give it the command's name alone.
    monkeypatch.setattr(sys, "argv", ["earl"])


@pytest.fixture(autouse=True)
def _no_run_seed_from_an_earlier_test(monkeypatch):
    # A part whose seed is unset takes the run's (PL_GLOBAL_SEED, which seed_everything sets for
    # the process): each test starts without one, as a fresh process does.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)

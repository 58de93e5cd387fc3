"""Shared test set-up."""

import sys

import pytest


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

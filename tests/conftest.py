"""Shared test set-up."""

import sys

import pytest


@pytest.fixture(autouse=True)
def _argv_of_the_earl_command(monkeypatch):
    # Tests run the `earl` command in-process with `main([...])`; LightningCLI warns when it also
    # sees pytest's own arguments in sys.argv, so give it the command's name alone.
    monkeypatch.setattr(sys, "argv", ["earl"])

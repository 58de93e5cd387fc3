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


# The modules that start whole runs (`earl` processes, torchrun launches, vLLM engines), longest
# first, as `--durations` ranked them (`python -m pytest -n 2 --dist loadscope tests`). Under
# loadscope each module goes whole to one worker, and xdist's own order (most tests first) sent
# these few-test modules out last, so the suite ended with one worker running a long module alone.
# Sent out first instead, the suite ends on the many short unit modules. A module not listed keeps
# its tier's place below; a renamed one only loses its head start.
FIRST = (
    "tests/e2e/test_scale_out.py",
    "tests/e2e/test_dataset_tasks.py",
    "tests/e2e/test_recipes.py",
    "tests/e2e/test_sft.py",
    "tests/e2e/test_first_hour.py",
    "tests/e2e/test_sft_tools.py",
    "tests/e2e/test_lora.py",
    "tests/e2e/test_vs_trl.py",
    "tests/e2e/test_multiprocess.py",
    "tests/e2e/test_gpu_acceptance_dry_run.py",
)
# then the tiers whose tests start processes or fits, the pure unit tests last
TIERS = ("vllm", "e2e", "distributed", "gpu", "unit")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def _module_rank(item) -> tuple[int, int]:
    module = item.nodeid.split("::")[0]
    if module in FIRST:
        return (0, FIRST.index(module))
    tier = module.split("/")[1] if module.count("/") >= 2 else ""
    return (1, TIERS.index(tier) if tier in TIERS else len(TIERS))


def pytest_collection_modifyitems(items):
    items.sort(key=_module_rank)  # stable: each module's tests keep their order, together

"""`EARL_HOST_MEMORY`: with `retain` a freed large block is reused without page faults; released,
every allocation of it faults its pages in again; a bad value is one clear error."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from earl_lightning.host_memory import ENV, apply_host_memory, host_memory_mode, release_host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
BLOCK = 64 << 20  # bytes: one activation of the multi-turn train pass is about this size
PAGES = BLOCK // resource.getpagesize()


@pytest.fixture(autouse=True)
def _back_to_release():
    yield
    release_host_memory()  # the worker's later tests see RSS follow live memory


def _faults_over(repeats: int) -> int:
    """Minor page faults of allocating, filling and freeing a 64 MiB tensor ``repeats`` times."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        x = torch.empty(BLOCK // 4, dtype=torch.float32)
        x.fill_(1.0)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_released_every_block_faults_in_again_and_retained_it_is_reused():
    assert release_host_memory()
    released = _faults_over(5)
    assert released > 0.8 * 5 * PAGES  # every allocation maps its 16k pages afresh

    assert apply_host_memory("retain")
    # The heap grows until the freed blocks fit the next request (glibc measured: 8 allocations, the
    # heap at ~9 blocks), then stays; bounded, that slack is what retaining costs.
    warmup = [_faults_over(1) for _ in range(16)]
    retained = _faults_over(5)
    assert retained < 0.05 * PAGES, (released, warmup, retained)
    assert not apply_host_memory("glibc")  # leaves malloc as it is


def test_the_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert host_memory_mode() == "retain"
    monkeypatch.setenv(ENV, " GLIBC ")
    assert host_memory_mode() == "glibc"


@pytest.mark.parametrize("build", ["rl", "sft"])
def test_a_bad_value_is_refused_when_the_module_is_built(build, monkeypatch):
    monkeypatch.setenv(ENV, "keep")
    if build == "rl":
        from earl_lightning.modules import AgenticRLModule as cls
    else:
        from earl_lightning.sft import WarmStartModule as cls
    with pytest.raises(ValueError, match=r"`EARL_HOST_MEMORY` must be one of retain, glibc, got 'keep'"):
        cls()

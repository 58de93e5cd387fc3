"""One torch thread for the runs a test module makes in pytest's own process (``main(["fit",
...])``, the Python API).

torch starts an intra-op thread a core. CI runs two pytest workers on two cores, so two such runs
at a time keep four threads busy on two cores, and OpenMP's waiting threads spin on cores the
others need: on the shared 2-core machine (load ~8) one of tests/e2e/test_algorithms.py's fits
spent 1.0 s of CPU with one thread and 2.3-6.5 s with two, to the same losses. The ranks of a
``--trainer.devices 2`` run already have one thread each (Lightning sets ``OMP_NUM_THREADS`` to the
cores a rank). Use it as ``pytestmark = pytest.mark.usefixtures("one_torch_thread")`` after
importing it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 for the module, then back to what they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

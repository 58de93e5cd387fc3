"""The dispatch cost model in benchmarks/dispatch.py: paper anchors and the scaling it claims."""

from __future__ import annotations

import pytest

from tests.load import load_repo_file


@pytest.fixture(scope="module")
def bench():
    return load_repo_file("benchmarks/dispatch.py", "dispatch_bench")


def test_table1_anchors(bench):
    assert bench.paper_total_gb(1024) == 15.6 and bench.paper_total_gb(32768) == 500.0
    assert bench.paper_total_gb(8192) == pytest.approx(124.8)


def test_centralized_busiest_rank_carries_the_whole_batch_twice(bench):
    rows = {(r["ranks"], r["context"], r["method"]): r for r in bench.cost_model()}
    c, d = rows[(1024, 32768, "centralized")], rows[(1024, 32768, "decentralized")]
    share_gb = 500.0 / 1024
    assert c["busiest_rank_gb"] == pytest.approx(2 * share_gb * 1023)
    assert d["busiest_rank_gb"] == pytest.approx(2 * share_gb * 1023 / 1024)
    # 500 GB of experience through one 25 Gbps NIC: ~160 s one way; the all-to-all: a fraction of a second.
    assert 150 < c["seconds_25gbps"] < 170 and d["seconds_25gbps"] < 0.2
    assert c["seconds_200gbps"] == pytest.approx(c["seconds_25gbps"] / 8, rel=0.01)


def test_runs_below_five_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--runs", "3"])

"""The profiler on 2 gloo processes: every stage under dp2xtp1 (FSDP train, dp-split inference)
and dp1xtp2 (TP replicas), the slowest rank's time and the global work, the same table on both
ranks."""

from __future__ import annotations

import pytest

from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed


def _profile(rank: int, world: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from earl_lightning.models import load_tokenizer
    from earl_lightning.parallel.layout import Layout
    from earl_lightning.profiling.profiler import ProfileGrid, profile_stages

    layouts = [Layout(2, 1, 256), Layout(1, 2, 256)]
    run = profile_stages(
        lambda: AutoModelForCausalLM.from_pretrained(path),
        load_tokenizer("earl-tiny"),
        layouts=layouts,
        grid=ProfileGrid(contexts=[32, 96], num_seqs=[3], gen_len=2),
        model_name="tiny",
    )
    return dict(table=run.table.to_dict(), measured=run.measured, skipped=run.skipped)


def test_profiles_every_layout_on_two_processes():
    from earl_lightning.models import make_tiny_model
    from earl_lightning.parallel.throughput import ProfileTable

    path = str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128))
    r0, r1 = run_distributed(_profile, 2, path)
    # times are the slowest rank's, work the global sum: one answer
    assert r0["table"] == r1["table"]
    assert r0["measured"] == 12 and r0["skipped"] == []
    table = ProfileTable.from_dict(r0["table"])
    assert table.world_size == 2
    for stage in ("rollout", "experience", "train"):
        assert table.layouts(stage) == ["dp2xtp1-mbt256", "dp1xtp2-mbt256"]
        assert table.contexts(stage) == [32, 96] and table.num_seqs_buckets(stage) == [3]
        assert all(t > 0 for s, *_, t in table.entries() if s == stage)

"""The time model and the device profiles `earl plan` reads (parallel/timing.py, parallel/hardware.py)."""

from __future__ import annotations

import json

import pytest

from earl_lightning.parallel.hardware import (
    DEVICES_DIR,
    Cluster,
    DeviceProfile,
    device_names,
    device_profile,
)
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.memory import MemoryModel
from earl_lightning.parallel.model_sizes import ModelSizes
from earl_lightning.parallel.selector import Selector
from earl_lightning.parallel.timing import TimeModel

# Qwen2.5-72B's sizes (benchmarks/configs/qwen2.5-72b-instruct.json)
Q72 = ModelSizes(80, 8192, 29568, 64, 8, 128, 152064, tie_word_embeddings=False)
GPUS = ("A100-40G", "A100-80G", "H100-80G", "H200-141G", "H800-80G")


def stats(context: int, num_seqs: int = 128, gen: int = 1) -> dict:
    return dict(
        num_seqs=num_seqs,
        context_mean=context,
        context_max=context,
        context_p95=context,
        gen_len=gen,
    )


def model(cluster: str = "16x8xH100-80G", **kw) -> TimeModel:
    memory = MemoryModel(Q72, "bfloat16", scored_share_limit=0.5, resident_train_state=True)
    return TimeModel(memory, Cluster.parse(cluster), **kw)


def test_every_shipped_profile_loads_and_cites_its_datasheet_figures():
    assert set(GPUS) | {"CPU"} <= set(device_names())
    for name in device_names():
        p = device_profile(name)
        assert p.name == name and p.kind in ("gpu", "cpu")
        for figure in ("memory_bytes", "peak_flops", "memory_bandwidth", "intra_node_bandwidth"):
            assert p.sources.get(figure) or p.sources.get("all"), (name, figure)


def test_profiles_are_the_datasheet_figures():
    h100, h200, a100 = (device_profile(n) for n in ("H100-80G", "H200-141G", "A100-80G"))
    assert h100.flops("bfloat16") == 989.4e12 and a100.flops("bfloat16") == 312e12
    assert h200.memory_bandwidth == 4.8e12 and h100.memory_bandwidth == 3.35e12
    assert (
        h100.intra_node_bandwidth == 450e9
        and device_profile("H800-80G").intra_node_bandwidth == 200e9
    )
    assert h100.inter_node_bandwidth == 50e9 and a100.inter_node_bandwidth == 25e9
    assert h200.memory_bytes > 1.7 * h100.memory_bytes


def test_a_profile_file_with_a_missing_or_bad_field_is_refused(tmp_path):
    data = json.loads((DEVICES_DIR / "H100-80G.json").read_text())
    with pytest.raises(ValueError, match=r"missing fields \['memory_bandwidth'\]"):
        DeviceProfile.from_dict({k: v for k, v in data.items() if k != "memory_bandwidth"}, "f")
    with pytest.raises(
        ValueError, match=r"matmul_efficiency` must be a number in \[0, 1\], got 1.5"
    ):
        DeviceProfile.from_dict({**data, "matmul_efficiency": 1.5}, "f")


@pytest.mark.parametrize(
    "text, message",
    [
        ("16x8xH100-90G", r"unknown device 'H100-90G'; known devices: \['A100-40G'"),
        ("16x8", r"must be NODESxPER_NODExDEVICE, e.g. 16x8xH100-80G; got '16x8'"),
        ("0x8xH100-80G", r"nodes and devices per node must be at least 1, got 0 node"),
        ("2x16xH100-80G", r"a H100-80G node holds at most 8 devices, got 16 per node"),
    ],
)
def test_a_bad_cluster_is_one_line_naming_the_flag(text, message):
    with pytest.raises(ValueError, match=message) as err:
        Cluster.parse(text, "--cluster")
    assert "`--cluster`" in str(err.value) and "\n" not in str(err.value)


def test_links_inside_a_node_and_across():
    c = Cluster.parse("16x8xH100-80G")
    d = c.device
    assert c.link(8, 8) == (d.intra_node_bandwidth * d.link_efficiency, d.intra_node_latency_s)
    assert c.link(16, 128) == (d.inter_node_bandwidth * d.link_efficiency, d.inter_node_latency_s)
    assert c.link(1, 1)[1] == 0.0


def test_decode_is_weight_bound_so_a_larger_tp_shard_halves_it():
    tm = model()
    tp4 = tm.breakdown("rollout", Layout(32, 4), stats(1024))["decode"]
    tp8 = tm.breakdown("rollout", Layout(16, 8), stats(1024))["decode"]
    # 4 vs 8 sequences per replica are far below the ~220 where bf16 decode turns compute-bound
    assert tp8 == pytest.approx(tp4 / 2, rel=0.1)


def test_every_stage_grows_with_the_context():
    tm = model(turns=8)
    for stage in ("rollout", "experience", "train"):
        for lay in (Layout(32, 4, 8192), Layout(16, 8, 8192, True)):
            times = [tm.seconds(stage, lay, stats(c)) for c in (1024, 4096, 16384)]
            assert times == sorted(times) and times[0] < times[-1], (stage, lay, times)


def test_checkpointing_costs_one_more_forward():
    tm = model()
    plain = tm.breakdown("train", Layout(16, 8, 8192), stats(8192))["compute"]
    ckpt = tm.breakdown("train", Layout(16, 8, 8192, True), stats(8192))["compute"]
    assert ckpt / plain == pytest.approx(4 / 3, rel=0.02)


def test_fsdp_across_nodes_is_exposed_only_beyond_compute():
    tm = model()
    short = tm.breakdown("train", Layout(128, 1, 8192), stats(1024))
    # 3 passes of the 145 GB model's shards over 40 GB/s of InfiniBand per micro-batch: ~10 s,
    # far more than the compute of one 1K-token sequence; at 32K tokens compute hides it
    assert short["fsdp_comm"] > 5 * short["compute"]
    assert tm.breakdown("train", Layout(128, 1, 8192), stats(32768))["fsdp_comm"] == 0.0


def test_the_all_to_all_beats_gather_then_scatter_by_one_to_two_times_the_ranks():
    """Bandwidth-bound: 2 (n-1) payloads through rank 0 against (n-1)/n of one per rank; the
    all-to-all's one message per peer costs latency that narrows the gap at many ranks."""
    tm = model()
    payload = 187 * 2**20
    for ranks in (16, 128):
        ratio = tm.dispatch_seconds(payload, ranks, "centralized") / tm.dispatch_seconds(
            payload, ranks
        )
        assert ranks < ratio < 2.1 * ranks, (ranks, ratio)
    with pytest.raises(ValueError, match="`method` must be 'all_to_all' or 'centralized'"):
        tm.dispatch_seconds(payload, 16, "gather")


def test_the_selector_reads_the_time_models_seconds_as_its_profile():
    """One source: the selector's predicted stage time is the time model's, and its first choice
    is the fastest candidate the memory model lets fit."""
    tm = model(turns=4)
    inference = [Layout(32, 4, 8192), Layout(16, 8, 8192)]
    train = [Layout(32, 4, 8192, True), Layout(16, 8, 8192, True)]
    per_stage = {"rollout": inference, "experience": inference, "train": train}
    for s in (stats(2048), stats(16384)):
        sel = Selector(per_stage, tm.memory, tm.table(per_stage, [s]), 80 * 2**30)
        for stage, cands in per_stage.items():
            d = sel.decide(stage, s)
            assert d.predicted_seconds == pytest.approx(tm.seconds(stage, d.layout, s), rel=1e-9)
            fits = [c for c in cands if sel.estimate(stage, c, s).total <= sel.usable_bytes]
            assert d.layout == min(fits, key=lambda c: tm.seconds(stage, c, s)), (stage, s)


def test_a_layout_of_another_world_size_is_refused():
    with pytest.raises(
        ValueError, match=r"`layout` dp4xtp1 has dp\*tp = 4, but the world size is 128"
    ):
        model().seconds("train", Layout(4, 1), stats(1024))

"""The reshard plan is pure: boxes in, transfers out. Checked without processes."""

from __future__ import annotations

import pytest

from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.reshard import intersect, plan_reshard


def rows(n: int, parts: int, i: int, cols: int = 4):
    """Box of chunk i of n rows split in `parts` (torch.chunk sizes)."""
    size = -(-n // parts)
    lo = min(i * size, n)
    return (lo, 0), (min(size, n - lo), cols)


def cols(n: int, parts: int, i: int, nrows: int = 8):
    (lo, _), (size, _) = rows(n, parts, i)
    return (0, lo), (nrows, size)


def plan(src, dst, bucket_bytes=1 << 20):
    n = len(src[0])
    return plan_reshard(src, dst, [4] * n, [4 * 32] * n, bucket_bytes, ["float32"] * n)


def test_intersect():
    assert intersect(((0, 0), (4, 4)), ((2, 2), (4, 4))) == ((2, 2), (2, 2))
    assert intersect(((0, 0), (2, 4)), ((2, 0), (2, 4))) is None


def test_same_placement_moves_nothing():
    # FSDP Shard(0) over 2 ranks vs colwise TP Shard(0) over the same 2 ranks.
    boxes = [[rows(8, 2, r)] for r in range(2)]
    p = plan(boxes, boxes)
    assert all(t.src == t.dst for t in p.transfers) and p.bytes_received(0, [4]) == 0


def test_shard0_to_shard1_moves_the_off_diagonal_quarters():
    src = [[rows(8, 2, r)] for r in range(2)]
    dst = [[cols(4, 2, r)] for r in range(2)]
    p = plan(src, dst)
    remote = [t for t in p.transfers if t.src != t.dst]
    assert sorted((t.src, t.dst, t.box) for t in remote) == [
        (0, 1, ((0, 2), (4, 2))),
        (1, 0, ((4, 0), (4, 2))),
    ]
    assert p.bytes_received(0, [4]) == 4 * 2 * 4


def test_replicated_source_spreads_sends_over_holders():
    # Source replicated on 4 ranks, destination sharded in 4: each rank keeps its own slice.
    full = ((0, 0), (8, 4))
    p = plan([[full]] * 4, [[rows(8, 4, r)] for r in range(4)])
    assert all(t.src == t.dst for t in p.transfers)
    # Source sharded in 2 on ranks {0, 1} and replicated on {2, 3}; destination fully replicated.
    src = [[rows(8, 2, r % 2)] for r in range(4)]
    p = plan(src, [[full]] * 4)
    sent = [sum(1 for t in p.transfers if t.src == r and t.dst != r) for r in range(4)]
    assert sent == [1, 1, 1, 1]  # balanced: no replica sends twice while another idles


def test_uneven_and_empty_shards_are_covered():
    src = [[rows(5, 4, r)] for r in range(4)]  # chunk sizes 2, 2, 1, 0
    dst = [[rows(5, 2, r)] for r in range(4)]
    p = plan(src, dst)
    for r in range(4):
        got = sum(t.box[1][0] * t.box[1][1] for t in p.transfers if t.dst == r)
        assert got == dst[r][0][1][0] * dst[r][0][1][1]


def test_gaps_in_the_source_are_an_error():
    with pytest.raises(RuntimeError, match="covered 16/32 elements"):
        plan([[rows(8, 2, 0)], [rows(8, 2, 0)]], [[((0, 0), (8, 4))]] * 2)


def test_buckets_split_on_size_and_dtype():
    p = plan_reshard(
        [[((0,), (8,))] * 4],
        [[((0,), (8,))] * 4],
        [4] * 4,
        [32] * 4,
        64,
        ["float32", "float32", "float32", "bfloat16"],
    )
    assert p.buckets == [[0, 1], [2], [3]]


def test_layout_coords_and_errors():
    layout = Layout(dp=2, tp=2)
    assert [layout.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(
        ValueError, match=r"`train_layout` dp2xtp2 has dp\*tp = 4, but the world size is 2"
    ):
        layout.check_world(2, arg="train_layout")
    with pytest.raises(
        ValueError,
        match=r"`layout` tp=4 does not divide the model's attention heads \(4\) and KV heads \(2\)",
    ):
        Layout(dp=1, tp=4).check_heads(4, 2)
    assert [lay.name for lay in Layout.factorizations(4, 4, 2)] == ["dp4xtp1", "dp2xtp2"]

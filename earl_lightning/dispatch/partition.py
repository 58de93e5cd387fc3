"""Balancing weights (token counts) over ``k`` parts so that the largest part sum is small:
Karmarkar-Karp's largest differencing method and LPT, the better of the two refined by a local
search. Deterministic, pure Python; the dispatch plan (:mod:`earl_lightning.dispatch.planner`)
balances sequences or whole groups over destination dp groups with it.
"""

from __future__ import annotations

import bisect
import heapq

from earl_lightning.core.checks import check_count

# Karmarkar-Karp keeps k-tuples of partial sums per item: O(n * k) memory. Past this many
# destination groups LPT (O(n log k), within 4/3 of optimal) and the local search run alone.
KK_MAX_PARTS = 64


def balanced_partition(weights: list[int], k: int) -> list[int]:
    """Part (in ``[0, k)``) of each weight so that the largest part sum is small.

    Runs Karmarkar-Karp's largest differencing method (k-way) and LPT, and keeps whichever has the
    smaller maximum (KK wins on many similar items, LPT on a few dominant ones). Deterministic.
    """
    check_count("k", k)
    if k == 1 or not weights:
        return [0] * len(weights)
    candidates = [_lpt(weights, k)]
    if k <= KK_MAX_PARTS:
        candidates.append(_karmarkar_karp(weights, k))
    best = min(candidates, key=lambda parts: max_load(weights, parts, k))
    return _refine(weights, best, k)


def max_load(weights: list[int], parts: list[int], k: int) -> int:
    """The largest part sum of ``parts`` (the part of each weight)."""
    loads = [0] * k
    for w, p in zip(weights, parts):
        loads[p] += w
    return max(loads)


def _refine(weights: list[int], parts: list[int], k: int, max_rounds: int = 64) -> list[int]:
    """Local search after the construction: move one item, or swap two, between the heaviest and
    the lightest part while that lowers the heavier of the two (fixes e.g. 5,5,4,4,3,3,3 into
    three parts, where KK and LPT both stop at 10 instead of 9)."""
    parts = list(parts)
    for _ in range(max_rounds):
        loads = [0] * k
        for w, p in zip(weights, parts):
            loads[p] += w
        hi = max(range(k), key=lambda p: (loads[p], -p))
        lo = min(range(k), key=lambda p: (loads[p], p))
        gap = loads[hi] - loads[lo]
        move = _best_exchange(weights, parts, hi, lo, gap)
        if move is None:
            return parts
        a, b = move
        parts[a] = lo
        if b is not None:
            parts[b] = hi
    return parts


def _best_exchange(weights: list[int], parts: list[int], hi: int, lo: int, gap: int):
    """(item of ``hi`` to move, item of ``lo`` to move back or None) shrinking ``gap`` the most;
    None when nothing helps. Moving weight ``d`` net leaves a gap of ``|gap - 2d|``."""
    heavy = sorted((weights[i], i) for i, p in enumerate(parts) if p == hi)
    light = sorted((weights[i], i) for i, p in enumerate(parts) if p == lo)
    light_w = [w for w, _ in light]
    best, best_gap = None, gap
    for wa, a in heavy:
        if abs(gap - 2 * wa) < best_gap:
            best, best_gap = (a, None), abs(gap - 2 * wa)
        # the partner b closest to wa - gap / 2 makes the net move closest to gap / 2
        j = bisect.bisect_left(light_w, wa - gap / 2)
        for jj in (j - 1, j):
            if 0 <= jj < len(light) and light_w[jj] < wa:
                new_gap = abs(gap - 2 * (wa - light_w[jj]))
                if new_gap < best_gap:
                    best, best_gap = (a, light[jj][1]), new_gap
    return best


def _lpt(weights: list[int], k: int) -> list[int]:
    """Longest processing time first: each item, largest first, to the lightest part."""
    heap = [(0, p) for p in range(k)]
    parts = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(heap)
        parts[i] = p
        heapq.heappush(heap, (load + weights[i], p))
    return parts


def _karmarkar_karp(weights: list[int], k: int) -> list[int]:
    """k-way largest differencing: repeatedly merge the two partial partitions whose spread
    (max - min part sum) is largest, pairing the heaviest part of one with the lightest of the
    other. Parts hold item trees (nested tuples) so a merge costs O(k), not O(items)."""
    heap = []
    for i, w in enumerate(weights):
        subsets = [(w, i)] + [(0, None)] * (k - 1)
        heap.append((-w, i, subsets))  # spread of a single item is its weight
    heapq.heapify(heap)
    tiebreak = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        b_light_first = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, (ta, tb)) for (sa, ta), (sb, tb) in zip(a, b_light_first)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tiebreak, merged))
        tiebreak += 1
    parts = [0] * len(weights)
    for p, (_, tree) in enumerate(heap[0][2]):
        for i in _leaves(tree):
            parts[i] = p
    return parts


def _leaves(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        elif node is not None:
            out.append(node)
    return out

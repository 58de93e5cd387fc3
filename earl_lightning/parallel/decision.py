"""What the layout selector decides with: a step's size class (:class:`Bucket`), each candidate
as the selector saw it (:class:`CandidateReport`), the rule that picks among them
(:func:`choose`: the fastest that fits, unless the incumbent is within the hysteresis) and the
:class:`Decision` it returns. Pure Python; the state (choices, infeasible marks, switch costs) is
the :class:`~earl_lightning.parallel.selector.Selector`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from earl_lightning.parallel.layout import SIZING_MICRO_BATCH_TOKENS, Layout
from earl_lightning.parallel.memory import check_stats


class Bucket(NamedTuple):
    """The step's size class: the powers of two at or above its longest context and sequence count."""

    context: int
    num_seqs: int


def bucket_of(stats: Mapping[str, Any]) -> Bucket:
    s = check_stats(stats)
    return Bucket(_pow2(s["context_max"]), _pow2(s["num_seqs"]))


def _pow2(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


@dataclass(frozen=True)
class CandidateReport:
    """One candidate as the selector saw it."""

    layout: str
    predicted_bytes: int
    fits: bool
    marked_infeasible: bool
    tokens_per_s: float | None
    seconds: float | None  # predicted stage time, without the switch
    switch_s: float  # cost of switching to it from the current layout (amortized)

    @property
    def usable(self) -> bool:
        return self.fits and not self.marked_infeasible

    @property
    def score(self) -> float:
        return (self.seconds or 0.0) + self.switch_s


@dataclass(frozen=True)
class Decision:
    """The chosen layout of one stage at one step, and why."""

    stage: str
    layout: Layout
    predicted_bytes: int
    predicted_tokens_per_s: float | None
    reason: str
    bucket: Bucket
    switched: bool  # differs from the layout the model was in
    predicted_seconds: float | None
    switch_cost_s: float
    candidates: tuple[CandidateReport, ...]


def choose(
    stage: str,
    usable: list[str],
    incumbent: str | None,
    reports: dict[str, CandidateReport],
    hysteresis: float,
) -> tuple[str, str]:
    """(the chosen layout's key, why) among the ``usable`` candidates: the fastest by predicted
    stage time plus switch cost, unless the ``incumbent`` is within ``hysteresis`` of it; without
    throughput data the incumbent, else the least parallelism that fits."""
    inc = reports.get(incumbent) if incumbent else None
    known = [k for k in usable if reports[k].seconds is not None]
    if not known:
        if inc is not None and inc.usable:
            return incumbent, f"keep {incumbent}: no profile data for stage {stage!r}"
        # Without throughput data prefer the least tensor parallelism (the fewest collectives),
        # then no recomputation, then the largest micro-batch.
        pick = min(
            usable, key=lambda k: (_tp_of(k), _ckpt_of(k), -_mbt_of(k), reports[k].predicted_bytes)
        )
        return pick, (
            f"{pick}: no profile data for stage {stage!r}; least tensor parallelism and "
            f"recomputation that fits"
        )
    # Ties (micro-batch variants of one dp x tp share its profile row): the larger micro-batch,
    # since fewer forward calls are never slower, then the smaller memory.
    best = min(known, key=lambda k: (reports[k].score, -_mbt_of(k), reports[k].predicted_bytes))
    b = reports[best]
    if inc is None or not inc.usable or inc.seconds is None:
        why = (
            "first choice"
            if inc is None
            else f"{incumbent} is " + ("unusable" if not inc.usable else "not in the profile")
        )
        return best, f"{best}: fastest that fits ({_rate(b)}); {why}"
    if best == incumbent:
        return best, f"keep {best}: still the fastest that fits ({_rate(b)})"
    gain = inc.score / b.score - 1.0 if b.score > 0 else 0.0
    if gain <= hysteresis:
        return incumbent, (
            f"keep {incumbent} ({_rate(inc)}): {best} would be {gain:.1%} faster "
            f"including a {b.switch_s:.2f}s switch, within the {hysteresis:.0%} hysteresis"
        )
    return best, (
        f"switch {incumbent} -> {best} ({_rate(b)}): {gain:.1%} faster including a "
        f"{b.switch_s:.2f}s switch, above the {hysteresis:.0%} hysteresis"
    )


def _tp_of(key: str) -> int:
    return int(key.split("xtp")[1].split("-")[0])


def _ckpt_of(key: str) -> bool:
    return key.endswith("-ckpt")


def _mbt_of(key: str) -> int:
    m = re.search(r"-mbt(\d+)", key)
    return int(m[1]) if m else SIZING_MICRO_BATCH_TOKENS


def _rate(r: CandidateReport) -> str:
    return (
        f"{r.tokens_per_s:.0f} tok/s, {gib(r.predicted_bytes)}"
        if r.tokens_per_s
        else gib(r.predicted_bytes)
    )


def gib(n: float) -> str:
    """``n`` bytes in GiB (MiB below one GiB), as decisions and errors print them."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

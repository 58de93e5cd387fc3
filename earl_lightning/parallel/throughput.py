"""The profiled throughput table: (stage, context bucket, num_seqs bucket, layout) -> tokens/s.

The EARL paper profiled its rollout engine once per tensor-parallel degree and context length and
then looked the table up; this table does the same for every stage. Tokens per second are the
stage's *work* tokens, so that ``work_tokens(stage, stats) / tokens_per_s`` predicts the stage's
seconds: generated tokens for rollout, all sequence tokens for experience and train. Whoever
fills the table (the profiler, a benchmark) must count the same way.

Layouts are stored by key: ``layout_key(layout)`` (dp x tp plus any non-default knob), and a
lookup falls back to the plain ``dp{d}xtp{t}`` name, then to the measured micro-batch variant of
the same dp x tp closest in log scale, so a table measured per (dp, tp) serves every micro-batch
variant of it.

Pure Python (matplotlib only inside :meth:`ProfileTable.heatmap`); no torch.distributed.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from earl_lightning.core.checks import check_count, check_number
from earl_lightning.parallel.layout import SIZING_MICRO_BATCH_TOKENS, STAGES, Layout, check_stage

SCHEMA_VERSION = 1
_LAYOUT_KEY = re.compile(r"^dp(\d+)xtp(\d+)(-mbt\d+)?(-ckpt)?$")


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, corrupt, or measured for another setup."""


def layout_key(layout: Layout) -> str:
    """``dp2xtp1``; a sized micro-batch budget other than ``SIZING_MICRO_BATCH_TOKENS`` (4096) and
    checkpointing are appended (``-mbt8192``, ``-ckpt``)."""
    key = layout.name
    if layout.sizing_tokens != SIZING_MICRO_BATCH_TOKENS:
        key += f"-mbt{layout.sizing_tokens}"
    if layout.activation_checkpointing:
        key += "-ckpt"
    return key


def work_tokens(stage: str, stats: Mapping[str, Any]) -> float:
    """The tokens a stage processes, the unit of the table's tokens/s (see the module docstring)."""
    check_stage(stage)
    if stage == "rollout":
        return float(stats["num_seqs"]) * float(stats["gen_len"])
    return float(stats["num_seqs"]) * float(stats["context_mean"])


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    """Linear interpolation in log(x) between sorted (x, y) points; clamped at both ends
    (outside the profiled range the nearest measured value is the least surprising guess)."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    j = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[j - 1], points[j]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


class ProfileTable:
    """Throughput per (stage, context, num_seqs, layout key), for one model on one world size.

    Args:
        model: what the numbers were measured for (a model name or a config fingerprint).
        world_size: the number of ranks the layouts span.
        device: free-form description of the hardware (stored, shown, not checked).
    """

    def __init__(self, model: str, world_size: int, device: str = "") -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"`model` must be a non-empty string, got {model!r}")
        check_count("world_size", world_size)
        self.model, self.world_size, self.device = model, world_size, str(device)
        self._entries: dict[tuple[str, int, int, str], float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProfileTable) and self.to_dict() == other.to_dict()

    # ---- filling ------------------------------------------------------------------------
    def add(
        self, stage: str, context: int, num_seqs: int, layout: Layout | str, tokens_per_s: float
    ) -> None:
        """Record one measurement (a later one for the same cell replaces it)."""
        self._put(stage, context, num_seqs, layout, tokens_per_s, where="ProfileTable.add")

    def _put(
        self, stage: Any, context: Any, num_seqs: Any, layout: Any, tps: Any, where: str
    ) -> None:
        key = self._check_entry(stage, context, num_seqs, layout, tps, where)
        self._entries[(stage, int(context), int(num_seqs), key)] = float(tps)

    def _check_entry(
        self, stage: Any, context: Any, num_seqs: Any, layout: Any, tps: Any, where: str
    ) -> str:
        if stage not in STAGES:
            raise ValueError(f"{where}: unknown stage {stage!r}; valid stages: {list(STAGES)}")
        try:
            check_count("context", context)
            check_count("num_seqs", num_seqs)
            check_number("tokens_per_s", tps, low=0, strict=True)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        key = layout_key(layout) if isinstance(layout, Layout) else layout
        m = _LAYOUT_KEY.match(key) if isinstance(key, str) else None
        if m is None:
            raise ValueError(
                f"{where}: `layout` must be a Layout or a key like 'dp2xtp1', got {layout!r}"
            )
        if int(m[1]) * int(m[2]) != self.world_size:
            raise ValueError(
                f"{where}: layout {key!r} spans {int(m[1]) * int(m[2])} ranks, but the table "
                f"is for world_size={self.world_size}"
            )
        return key

    # ---- reading ------------------------------------------------------------------------
    def stages(self) -> list[str]:
        return [s for s in STAGES if any(k[0] == s for k in self._entries)]

    def layouts(self, stage: str) -> list[str]:
        return sorted({k[3] for k in self._entries if k[0] == stage}, key=_layout_sort)

    def contexts(self, stage: str) -> list[int]:
        return sorted({k[1] for k in self._entries if k[0] == stage})

    def num_seqs_buckets(self, stage: str) -> list[int]:
        return sorted({k[2] for k in self._entries if k[0] == stage})

    def entries(self) -> Iterable[tuple[str, int, int, str, float]]:
        for (stage, ctx, nseq, key), tps in sorted(self._entries.items()):
            yield stage, ctx, nseq, key, tps

    def has(self, stage: str, layout: Layout | str) -> bool:
        return self._resolve(stage, layout) is not None

    def lookup(
        self, stage: str, layout: Layout | str, context: float, num_seqs: float
    ) -> float | None:
        """Predicted tokens/s, interpolated linearly in log(context) within each measured
        num_seqs bucket, then linearly in log(num_seqs) between the two nearest buckets;
        clamped outside the measured range. None when the layout was never measured for ``stage``."""
        check_stage(stage)
        key = self._resolve(stage, layout)
        if key is None:
            return None
        by_nseq: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for (s, ctx, nseq, k), tps in self._entries.items():
            if s == stage and k == key:
                by_nseq[nseq].append((float(ctx), tps))
        curve = sorted(
            (float(n), _interp_log(sorted(pts), max(float(context), 1.0)))
            for n, pts in by_nseq.items()
        )
        return _interp_log(curve, max(float(num_seqs), 1.0))

    def _resolve(self, stage: str, layout: Layout | str) -> str | None:
        keys = {k[3] for k in self._entries if k[0] == stage}
        if isinstance(layout, Layout):
            for key in (layout_key(layout), layout.name):
                if key in keys:
                    return key
            return _nearest_variant(layout, keys)
        return layout if layout in keys else None

    # ---- (de)serialization --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "world_size": self.world_size,
            "device": self.device,
            "entries": [
                dict(stage=s, context=c, num_seqs=n, layout=k, tokens_per_s=t)
                for s, c, n, k, t in self.entries()
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "the profile table") -> ProfileTable:
        """Rebuild a table; every problem raises :class:`ProfileError` naming ``source``."""
        if not isinstance(data, dict):
            raise ProfileError(
                f"{source} is corrupt: expected a JSON object, got {type(data).__name__}"
            )
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"{source} has schema_version {version!r}; this version of earl_lightning "
                f"reads schema_version {SCHEMA_VERSION}. Re-run the profiler."
            )
        try:
            table = cls(data.get("model"), data.get("world_size"), data.get("device", ""))
        except ValueError as err:
            raise ProfileError(f"{source} is corrupt: {err}") from None
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise ProfileError(
                f"{source} is corrupt: `entries` must be a list, got {type(entries).__name__}"
            )
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise ProfileError(
                    f"{source} is corrupt: entries[{i}] must be an object, got {e!r}"
                )
            try:
                table._put(
                    e.get("stage"),
                    e.get("context"),
                    e.get("num_seqs"),
                    e.get("layout"),
                    e.get("tokens_per_s"),
                    where=f"{source} is corrupt: entries[{i}]",
                )
            except ValueError as err:
                raise ProfileError(str(err)) from None
        return table

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(
        cls, path: str | os.PathLike, *, model: str | None = None, world_size: int | None = None
    ) -> ProfileTable:
        """Read a saved table; ``model`` / ``world_size``, when given, must match what it was measured for."""
        src = f"profile file '{path}'"
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ProfileError(f"cannot read {src}: {err.strerror or err}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProfileError(
                f"{src} is corrupt: not valid JSON ({err.msg} at line {err.lineno})"
            ) from None
        table = cls.from_dict(data, src)
        table.check_matches(model=model, world_size=world_size, source=src)
        return table

    def check_matches(
        self,
        *,
        model: str | None = None,
        world_size: int | None = None,
        source: str = "the profile table",
    ) -> None:
        if world_size is not None and world_size != self.world_size:
            raise ProfileError(
                f"{source} was measured for world_size={self.world_size}, but this run has "
                f"world_size={world_size}; profile again for this world size"
            )
        if model is not None and model != self.model:
            raise ProfileError(
                f"{source} was measured for model {self.model!r}, but this run uses "
                f"{model!r}; profile again for this model"
            )

    # ---- picture ------------------------------------------------------------------------
    def heatmap(self, stage: str, path: str | os.PathLike) -> Path:
        """A PNG like the EARL paper's Fig. 3: tokens/s per layout (rows) x context (columns), one
        panel per num_seqs bucket; the fastest layout of each column is starred."""
        check_stage(stage)
        if stage not in self.stages():
            raise ValueError(
                f"`stage` {stage!r} has no entries in this table; stages with data: {self.stages()}"
            )
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt

        layouts, ctxs, nseqs = (
            self.layouts(stage),
            self.contexts(stage),
            self.num_seqs_buckets(stage),
        )
        fig, axes = plt.subplots(
            1,
            len(nseqs),
            figsize=(1.2 + 1.1 * len(ctxs) * len(nseqs), 0.9 + 0.55 * len(layouts)),
            squeeze=False,
        )
        for ax, n in zip(axes[0], nseqs):
            grid = [[self._entries.get((stage, c, n, k), math.nan) for c in ctxs] for k in layouts]
            _draw_panel(ax, grid, [str(c) for c in ctxs], layouts, f"{n} seqs")
        fig.suptitle(f"{stage} tokens/s, {self.model}, world {self.world_size}", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def heatmaps(self, directory: str | os.PathLike, prefix: str = "profile") -> list[Path]:
        """One PNG per stage with data: ``<directory>/<prefix>_<stage>.png``."""
        return [self.heatmap(s, Path(directory) / f"{prefix}_{s}.png") for s in self.stages()]


def _draw_panel(
    ax: Any, grid: list[list[float]], xlabels: list[str], ylabels: list[str], title: str
) -> None:
    ax.imshow(grid, aspect="auto", cmap="viridis")
    for j in range(len(xlabels)):
        col = [(v, i) for i, v in enumerate(row[j] for row in grid) if not math.isnan(v)]
        best = max(col)[1] if col else -1
        for v, i in col:
            ax.text(
                j,
                i,
                f"{v:.0f}{'*' if i == best else ''}",
                ha="center",
                va="center",
                fontsize=7,
                fontweight="bold" if i == best else "normal",
                bbox=dict(facecolor="white", alpha=0.7, lw=0, pad=1),
            )
    ax.set_xticks(range(len(xlabels)), xlabels, fontsize=7)
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=7)
    ax.set_xlabel("context length (tokens)")
    ax.set_title(title, fontsize=8)


def _nearest_variant(layout: Layout, keys: set[str]) -> str | None:
    """A measured micro-batch variant of the same dp x tp (and checkpointing), the closest budget
    in log scale: a table profiled at one micro-batch size still ranks the placements."""
    best, best_d = None, math.inf
    for key in sorted(keys):
        m = _LAYOUT_KEY.match(key)
        if m is None or (int(m[1]), int(m[2]), bool(m[4])) != (
            layout.dp,
            layout.tp,
            layout.activation_checkpointing,
        ):
            continue
        mbt = int(m[3][4:]) if m[3] else SIZING_MICRO_BATCH_TOKENS
        d = abs(math.log(mbt) - math.log(layout.sizing_tokens))
        if d < best_d:
            best, best_d = key, d
    return best


def _layout_sort(key: str) -> tuple[int, int, str]:
    m = _LAYOUT_KEY.match(key)
    return (int(m[2]), int(m[1]), key) if m else (0, 0, key)

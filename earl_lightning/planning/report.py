"""The plan as files and text: the per-stage CSVs, a summary per policy (where it runs out of
memory, its total time), a PNG, and the tables ``earl plan`` prints."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

from earl_lightning.parallel.decision import gib
from earl_lightning.parallel.layout import STAGES
from earl_lightning.planning.plan import PlanResult

ADAPTIVE = "adaptive"


def summary(result: PlanResult) -> list[dict[str, Any]]:
    """One row per policy (adaptive first): the contexts where a stage does not fit and the first
    of them; the seconds of the steps before it (one step per context); and those seconds over
    adaptive's seconds for the same steps."""
    by_policy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in result.adaptive:
        by_policy[ADAPTIVE].append(r)
    for r in result.static:
        by_policy[r["policy"]].append(r)
    adaptive = step_seconds(result.adaptive)
    out = []
    for policy, rows in by_policy.items():
        oom = sorted({r["context"] for r in rows if not r["fits"]})
        first = oom[0] if oom else None
        steps = {c: t for c, t in step_seconds(rows).items() if first is None or c < first}
        total = sum(steps.values())
        same = sum(adaptive[c] for c in steps)
        out.append(
            {
                "policy": policy,
                "oom_contexts": " ".join(str(c) for c in oom),
                "first_oom": first or "",
                "contexts_run": len(steps),
                "total_seconds": total,
                "vs_adaptive": total / same if same else float("nan"),
            }
        )
    return out


def step_seconds(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds per step (all stages) by context."""
    out: dict[int, float] = defaultdict(float)
    for r in rows:
        out[r["context"]] += r["seconds"]
    return dict(out)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(
            {k: f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )
    return path


def write_all(result: PlanResult, out: Path) -> list[Path]:
    """plan.csv (adaptive), plan_static.csv, plan_summary.csv and plan.png under ``out``."""
    return [
        write_csv(out / "plan.csv", result.adaptive),
        write_csv(out / "plan_static.csv", result.static),
        write_csv(out / "plan_summary.csv", summary(result)),
        plot(result, out / "plan.png"),
    ]


def plot(result: PlanResult, path: Path) -> Path:
    """Left: seconds per step by context for adaptive and every static policy (x: out of
    memory there). Right: adaptive's predicted peak per device and stage against the budget."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax, mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    ctxs = result.settings.contexts
    statics = defaultdict(list)
    for r in result.static:
        statics[r["policy"]].append(r)
    for i, (policy, rows) in enumerate(sorted(statics.items())):
        _policy_line(ax, policy, rows, ctxs, color=f"C{i % 10}", width=0.8, alpha=0.45)
    _policy_line(ax, ADAPTIVE, result.adaptive, ctxs, color="black", width=2.4, alpha=1.0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("predicted seconds per RL step")
    ax.set_title("adaptive (black) vs static layouts; x = out of memory", fontsize=9)
    ax.legend(fontsize=5, ncol=2)
    for stage in STAGES:
        rows = [r for r in result.adaptive if r["stage"] == stage]
        mem.plot(
            [r["context"] for r in rows], [r["peak_gib"] for r in rows], marker="o", label=stage
        )
    mem.axhline(result.usable_bytes / 2**30, color="red", ls="--", label="usable (budget - 10%)")
    mem.set_xscale("log", base=2)
    mem.set_xlabel("context length (tokens)")
    mem.set_ylabel("predicted peak GiB per device (adaptive)")
    mem.legend(fontsize=7)
    s = result.settings
    fig.suptitle(
        f"earl plan: {s.model_name}, {s.cluster.name}, {s.dtype}, {s.num_seqs} sequences",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _policy_line(ax, policy, rows, ctxs, *, color, width, alpha) -> None:
    steps, ooms = step_seconds(rows), {r["context"] for r in rows if not r["fits"]}
    ok = [c for c in ctxs if c not in ooms]
    ax.plot(ok, [steps[c] for c in ok], color=color, lw=width, alpha=alpha, label=policy)
    bad = [c for c in ctxs if c in ooms]
    ax.scatter(bad, [steps[c] for c in bad], marker="x", color=color, alpha=alpha)


def format_tables(result: PlanResult) -> str:
    """The text ``earl plan`` prints: adaptive's choice per context and stage, then every policy's
    out-of-memory contexts and total time."""
    s = result.settings
    lines = [
        f"plan: {s.model_name} ({s.dtype}) on {s.cluster.name}, {s.num_seqs} sequences per step, "
        f"recipe {s.recipe.path}; train placement dp{result.train_placement[0]}xtp{result.train_placement[1]}; "
        f"usable {result.usable_bytes / 2**30:.1f} of {result.budget_bytes / 2**30:.1f} GiB per device",
        "",
        f"{'context':>8} {'stage':10} {'layout (adaptive)':26} {'peak':>10} {'seconds':>9}",
    ]
    for r in result.adaptive:
        flag = "" if r["fits"] else "  OUT OF MEMORY: no layout fits"
        lines.append(
            f"{r['context']:>8} {r['stage']:10} {r['layout']:26} {gib(r['peak_bytes']):>10} "
            f"{r['seconds']:>9.2f}{flag}"
        )
    lines += [
        "",
        "one step per context; 'seconds' and 'x adaptive': the steps before the first out-of-memory",
        f"{'policy':28} {'out of memory at':34} {'steps':>5} {'seconds':>9} {'x adaptive':>10}",
    ]
    for r in summary(result):
        lines.append(
            f"{r['policy']:28} {r['oom_contexts'] or '-':34} {r['contexts_run']:>5} "
            f"{r['total_seconds']:>9.1f} {r['vs_adaptive']:>10.2f}"
        )
    return "\n".join(lines)

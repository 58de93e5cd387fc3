"""The operator floor of earl's multi-turn step: how much of the rollout and train stages
is time inside PyTorch operators (attention, matmuls, the rest) and how much is Python and framework
overhead around them, and what speed-up over TRL the step could reach if that overhead went away.

Runs earl's side of the multi-turn point of ``benchmarks/vs_trl.py`` (DigitTurns, 10 turns of 8
tokens, 64 episodes in groups of 8, earl-tiny, fp32, 2 threads) in this process. After the warm-up
steps, each step runs its rollout and its update (``ppo_update``: all of the train stage, forward,
backward and optimizer step) under ``torch.profiler``. An operator's time is its ``aten::`` self
time (its kernel plus the dispatcher in C++); what the call's wall time holds beyond the sum of
those is overhead: Python (the model's modules, the rollout loop, the chat template, the
environment) and the profiler's own hooks, so the overhead read here is an upper bound. The two
stages' operator seconds are the floor of a step with no overhead at all. Given a ``vs_trl.py``
medians CSV from the same machine (``--trl-csv``), the ratio it measured (TRL's seconds per
multi-turn step over earl's) times the two stages' wall over their floor bounds what removing every
overhead could reach (generously: the profiler's hooks count as overhead, and the rest of the step
is taken as free). Both factors are measured side by side, so the machine's speed cancels out of
each; wall and operator seconds are read from the same calls.

A profiled call can take page faults that an unprofiled step does not: the profiler's own buffers
fragment the heap, so the next step's activations may grow it, and the kernel time of those first
touches lands in whichever operator touched the page (the train stage's elementwise operators
above all). The figures are therefore the means over the profiled calls with the fewest page faults
(within :data:`FAULT_SLACK` pages of the fewest); ``<stage>_calls_used`` and
``<stage>_page_faults`` say which.

    python benchmarks/step_floor.py --trl-csv benchmarks/results/vs_trl.csv   # 2 warm-up steps, then 5 profiled
    python benchmarks/step_floor.py --batch 8 --group 4 --turns 2 --steps 1 --out /tmp/floor.csv  # a smoke run

Writes ``benchmarks/results/step_floor.csv`` (``what,value,unit``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_roofline import write_rows  # noqa: E402
from benchmarks.vs_trl import multi_turn_seconds  # noqa: E402
from benchmarks.vs_trl_sides import RunSpec, run_earl  # noqa: E402

CATEGORIES = ("attention", "matmul", "other_ops")
FAULT_SLACK = 5000  # pages (20 MiB of 4 KiB pages) above a stage's fewest that a call used may have


def category(op: str) -> str | None:
    """The category of a profiler event: ``attention`` (SDPA and its kernels, forward and backward),
    ``matmul`` (mm, addmm, bmm and their batched forms), ``other_ops`` (every other ``aten::`` op),
    None for what is not an operator (``record_function`` ranges, autograd's bookkeeping nodes)."""
    if not op.startswith("aten::"):
        return None
    name = op[len("aten::") :]
    if "attention" in name:
        return "attention"
    if name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation"):
        return "matmul"
    return "other_ops"


def op_seconds(self_seconds: dict[str, float]) -> dict[str, float]:
    """Self seconds per profiler event name -> seconds per category (:data:`CATEGORIES`)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, seconds in self_seconds.items():
        cat = category(name)
        if cat is not None:
            out[cat] += seconds
    return out


class StageProfiler:
    """Wraps a function so that every call after the first ``warmup`` runs under ``torch.profiler``;
    ``profiled`` gets each such call's wall seconds (``wall``), its operators' self seconds by
    category, and the page faults the process took during it (``page_faults``)."""

    def __init__(self, fn: Callable[..., Any], warmup: int) -> None:
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.profiled: list[dict[str, float]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.profiler import ProfilerActivity, profile

        self.calls += 1
        if self.calls <= self.warmup:
            return self.fn(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            out = self.fn(*args, **kwargs)
            wall = time.perf_counter() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        self.profiled.append(
            {
                "wall": wall,
                "page_faults": float(faults),
                **op_seconds({e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}),
            }
        )
        return out


def measured_ratio(path: Path | None, completion_len: int, turns: int) -> float | None:
    """TRL's median seconds per multi-turn step over earl's, from a ``vs_trl.py`` medians CSV."""
    if path is None:
        return None
    seconds = multi_turn_seconds(path, completion_len, turns)
    if not {"earl", "trl"} <= set(seconds):
        raise SystemExit(
            f"--trl-csv {str(path)!r} has no earl and TRL multi-turn rows for {turns} turns of "
            f"{completion_len} tokens (found sides: {sorted(seconds) or 'none'})"
        )
    return seconds["trl"] / seconds["earl"]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the steps with the rollout and the update wrapped in :class:`StageProfiler`; returns each
    profiled call's wall and operator seconds per stage, and the load around the run."""
    import earl_lightning.modules.rl as rl
    import earl_lightning.rollout.loop as loop

    # the RL step plays through rollout_setup.play_share, which reads loop.rollout at each call
    wrapped = {
        "rollout": StageProfiler(loop.rollout, args.warmup),
        "train": StageProfiler(rl.ppo_update, args.warmup),
    }
    loop.rollout, rl.ppo_update = wrapped["rollout"], wrapped["train"]
    load = [os.getloadavg()[0]]
    spec = RunSpec(
        side="earl",
        mode="multi",
        completion_len=args.reply_len,
        turns=args.turns,
        steps=args.warmup + args.steps,
        warmup=args.warmup,
        batch=args.batch,
        group=args.group,
    )
    run_earl(spec)
    load.append(os.getloadavg()[0])
    return {"profiled": {k: w.profiled for k, w in wrapped.items()}, "load": load}


def fewest_faults(calls: list[dict[str, float]]) -> list[dict[str, float]]:
    """The profiled calls with the fewest page faults: within :data:`FAULT_SLACK` of the fewest."""
    least = min(c["page_faults"] for c in calls)
    return [c for c in calls if c["page_faults"] <= least + FAULT_SLACK]


def report_rows(m: dict[str, Any], ratio: float | None) -> list[tuple[str, float, str]]:
    rows: list[tuple[str, float, str]] = []
    walls = ops_total = 0.0
    for stage in ("rollout", "train"):
        calls = fewest_faults(m["profiled"][stage])
        mean = {
            k: statistics.mean(c[k] for c in calls) for k in ("wall", "page_faults", *CATEGORIES)
        }
        ops = sum(mean[c] for c in CATEGORIES)
        walls, ops_total = walls + mean["wall"], ops_total + ops
        rows += [
            (f"{stage}_calls_used", float(len(calls)), f"of {len(m['profiled'][stage])} profiled"),
            (f"{stage}_page_faults", mean["page_faults"], "pages"),
            (f"{stage}_wall", mean["wall"], "s"),
            *((f"{stage}_{c}", mean[c], "s") for c in CATEGORIES),
            (f"{stage}_ops", ops, "s"),
            (f"{stage}_overhead", mean["wall"] - ops, "s"),
            (f"{stage}_overhead_share", (mean["wall"] - ops) / mean["wall"], "ratio"),
        ]
    rows += [
        ("two_stages_wall", walls, "s"),
        ("two_stages_ops", ops_total, "s"),
        ("load_before", m["load"][0], "1-min load"),
        ("load_after", m["load"][1], "1-min load"),
    ]
    if ratio is not None:
        rows += [
            ("vs_trl_ratio_measured", ratio, "x"),
            ("vs_trl_ratio_bound_no_overhead", ratio * walls / ops_total, "x"),
        ]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="profiled steps after the warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply-len", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--trl-csv",
        type=Path,
        default=None,
        help="a vs_trl.py medians CSV from the same machine (its earl and TRL multi-turn rows)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_floor.csv")
    args = p.parse_args(argv)
    for name in ("steps", "warmup", "batch", "group", "turns", "reply_len", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ratio = measured_ratio(args.trl_csv, args.reply_len, args.turns)
    write_rows(report_rows(measure(args), ratio), args.out)


if __name__ == "__main__":
    main()

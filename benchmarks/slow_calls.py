"""Rollout wall time with slow environment calls: sequential, concurrent (lock-step) and continuous.

64 episodes x 5 turns of the real tiny model (earl-tiny, HF backend) against an environment whose
every call takes 0.5 s (``uniform``), or 0.5 s except 10% of calls that take 2 s (``heavy``), drawn
per (episode, turn) from a fixed seed. Three ways to run the calls:

- ``sequential``: one call at a time (``call_workers=1``, lock-step turns), the first version's way;
- ``concurrent``: every call of a turn at once, each turn waiting for the slowest (``call_workers=64``);
- ``continuous``: every call at once, and an episode whose call returned generates again without
  waiting for the others (``continuous_turns``).

The goal: continuous at most 1.3 x (generation time + the slowest episode's own
chain of calls). Generation time is the same rollout with instant calls; the slowest chain is the
largest sum of one episode's call times. The modes alternate within each repeat; medians are
reported with the machine's load before and after.

    python benchmarks/slow_calls.py                 # 3 repeats (sequential once: ~3 min a case)
    python benchmarks/slow_calls.py --quick         # 8 episodes x 3 turns, 1 repeat

Writes ``benchmarks/results/slow_calls.csv`` (every run), ``slow_calls_summary.csv`` and
``slow_calls.png``, and prints the table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import write_csv  # noqa: E402
from earl_lightning.envs.base import StepResult  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = {
    "sequential": dict(call_workers=1, continuous=False),
    "concurrent": dict(call_workers=64, continuous=False),
    "continuous": dict(call_workers=64, continuous=True),
}
CASES = {
    "uniform": dict(latency_s=0.5, tail_share=0.0, tail_s=2.0),
    "heavy": dict(latency_s=0.5, tail_share=0.1, tail_s=2.0),
}


def latency(seed: int, turn: int, latency_s: float, tail_share: float, tail_s: float) -> float:
    """The time the call of ``turn`` of episode ``seed`` takes: a fixed draw."""
    return tail_s if random.Random(seed * 1009 + turn).random() < tail_share else latency_s


class SlowCallEnv:
    """Every step sleeps its drawn latency, then answers; the episode ends after ``turns`` steps."""

    def __init__(
        self, turns: int = 5, latency_s: float = 0.5, tail_share: float = 0.0, tail_s: float = 2.0
    ) -> None:
        self.turns, self.kw = turns, dict(latency_s=latency_s, tail_share=tail_share, tail_s=tail_s)

    def reset(self, seed: int) -> str:
        self.seed, self.turn = seed, 0
        return "Say anything."

    def step(self, action: str) -> StepResult:
        time.sleep(latency(self.seed, self.turn, **self.kw))
        self.turn += 1
        return StepResult("Again.", 0.0, self.turn >= self.turns, {})


def one_run(
    model, tok, episodes: int, turns: int, case: dict, mode: dict, instant: bool = False
) -> float:
    from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout

    kwargs = {**case, "latency_s": 0.0, "tail_share": 0.0} if instant else case
    specs = [
        EpisodeSpec(
            "benchmarks.slow_calls.SlowCallEnv",
            seed=s,
            group_id=s,
            episode_id=s,
            env_kwargs={"turns": turns, **kwargs},
        )
        for s in range(episodes)
    ]
    t0 = time.perf_counter()
    rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=8, seed=0),
        max_turns=turns,
        max_context_tokens=2048,
        env_timeout_s=60.0,
        **mode,
    )
    return time.perf_counter() - t0


def slowest_chain(episodes: int, turns: int, case: dict) -> float:
    return max(sum(latency(s, t, **case) for t in range(turns)) for s in range(episodes))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--sequential-repeats", type=int, default=1, help="sequential runs are long: fewer of them"
    )
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--quick", action="store_true", help="8 episodes x 3 turns, 1 repeat")
    p.add_argument("--out", default=str(RESULTS / "slow_calls.csv"))
    args = p.parse_args(argv)
    if args.quick:
        args.episodes, args.turns, args.repeats = 8, 3, 1
    import torch
    from transformers import AutoModelForCausalLM

    from earl_lightning.models import load_tokenizer, make_tiny_model

    torch.set_num_threads(2)
    path = make_tiny_model("earl-tiny")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))
    runs = []
    for case_name in args.cases:
        case = CASES[case_name]
        for r in range(args.repeats):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in [*order, "generation"]:
                if mode == "sequential" and r >= args.sequential_repeats:
                    continue
                load = os.getloadavg()[0]
                seconds = one_run(
                    model,
                    tok,
                    args.episodes,
                    args.turns,
                    case,
                    MODES.get(mode, MODES["continuous"]),
                    instant=mode == "generation",
                )
                runs.append(
                    {
                        "case": case_name,
                        "mode": mode,
                        "repeat": r,
                        "seconds": seconds,
                        "load_before": load,
                        "load_after": os.getloadavg()[0],
                    }
                )
                print(f"{case_name:8s} {mode:11s} repeat {r}: {seconds:7.2f} s", flush=True)
    summary = summarize(runs, args)
    out = Path(args.out)
    write_csv(out, runs, ["case", "mode", "repeat", "seconds", "load_before", "load_after"])
    write_csv(
        out.with_name(out.stem + "_summary.csv"),
        summary,
        [
            "case",
            "mode",
            "seconds",
            "runs",
            "generation_s",
            "slowest_chain_s",
            "ideal_s",
            "x_ideal",
            "goal_met",
        ],
    )
    plot(summary, out.with_suffix(".png"))
    print(
        f"\n{'case':8s} {'mode':11s} {'median s':>9s} {'ideal s':>8s} {'x ideal':>8s}  goal (<= 1.3x)"
    )
    for row in summary:
        print(
            f"{row['case']:8s} {row['mode']:11s} {row['seconds']:9.2f} {row['ideal_s']:8.2f} {row['x_ideal']:8.2f}  "
            f"{row['goal_met']}"
        )
    return 0


def summarize(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    out = []
    for case in args.cases:
        gen = statistics.median(
            r["seconds"] for r in runs if r["case"] == case and r["mode"] == "generation"
        )
        chain = slowest_chain(args.episodes, args.turns, CASES[case])
        for mode in MODES:
            secs = [r["seconds"] for r in runs if r["case"] == case and r["mode"] == mode]
            if not secs:
                continue
            median = statistics.median(secs)
            ratio = median / (gen + chain)
            out.append(
                {
                    "case": case,
                    "mode": mode,
                    "seconds": median,
                    "runs": len(secs),
                    "generation_s": gen,
                    "slowest_chain_s": chain,
                    "ideal_s": gen + chain,
                    "x_ideal": ratio,
                    "goal_met": "yes" if ratio <= 1.3 else "no",
                }
            )
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in summary}, key=list(CASES).index)
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows = [r for r in summary if r["case"] == case]
        ax.bar(
            [r["mode"] for r in rows],
            [r["seconds"] for r in rows],
            color=["tab:gray", "tab:orange", "tab:blue"],
        )
        ax.axhline(rows[0]["ideal_s"], color="black", ls="--", label="generation + slowest chain")
        ax.axhline(1.3 * rows[0]["ideal_s"], color="tab:red", ls=":", label="goal: 1.3 x that")
        ax.set_yscale("log")
        ax.set_ylabel("rollout wall seconds (median)")
        ax.set_title(f"{case}: 64 episodes x 5 turns")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

"""Step time of a user's agent through the endpoint against the native tool path, same task.

The calculator task both ways, from the same warm start: the built-in environment with its tool
through the chat template (``recipes/calculator_grpo_warm.yaml``), and the same task written as an
OpenAI-SDK agent (``recipes/calculator_agent_grpo_warm.yaml``: 64 agents at once, each a real
``openai.AsyncOpenAI`` client calling the endpoint over HTTP). Each run is a real ``earl fit``
process of ``--steps`` RL steps (64 episodes, groups of 8); a step's time is the sum of its
stages' seconds (rollout, experience, train), the first step is left out (warm-up), and the run's
median is taken. The two sides alternate within each repeat (the order flips every repeat); the
table gives the medians over repeats, the ratio agent / native (goal: <= 1.25x), rollout tokens
per second, and the machine's load before and after each run.

    earl sft --config recipes/calculator_sft.yaml        # the warm start both sides load
    python benchmarks/agent_endpoint.py                   # 3 repeats x 2 sides x 6 steps
    python benchmarks/agent_endpoint.py --quick           # 1 repeat, 3 steps, earl-tiny-bpe-4l

Writes ``benchmarks/results/agent_endpoint.csv`` (every run) and ``agent_endpoint_summary.csv``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import write_csv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIDES = {
    "native": ROOT / "recipes" / "calculator_grpo_warm.yaml",
    "agent": ROOT / "recipes" / "calculator_agent_grpo_warm.yaml",
}
STAGES = ("rollout", "experience", "train")


def fit_args(side: str, model: str, steps: int, root: Path, data: Path) -> list[str]:
    args = [
        "fit",
        "--config",
        str(SIDES[side]),
        "--model.model",
        model,
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.callbacks",
        "[]",
        "--trainer.enable_progress_bar",
        "false",
        "--data.eval_episodes",
        "0",
        "--export.enabled",
        "false",
    ]
    if side == "agent":
        files = {"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")}
        args += ["--data.dataset.data_files", json.dumps(files)]
    return args


def per_step(root: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for ev in root.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(ev))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def one_run(side: str, model: str, steps: int, data: Path) -> dict:
    earl = Path(sys.executable).with_name("earl")
    with tempfile.TemporaryDirectory() as tmp:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [str(earl), *fit_args(side, model, steps, Path(tmp), data)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        if proc.returncode:
            raise SystemExit(f"{side} run failed:\n{proc.stderr[-3000:]}")
        wall = time.perf_counter() - t0
        m = per_step(Path(tmp))
    kept = sorted(m["stage/rollout/seconds"])[1:]  # the first step warms up
    step_s = [sum(m[f"stage/{s}/seconds"][k] for s in STAGES) for k in kept]
    rollout_s = [m["stage/rollout/seconds"][k] for k in kept]
    tokens = [m["tokens/generated"][k] for k in kept]
    return {
        "side": side,
        "step_s": statistics.median(step_s),
        "rollout_s": statistics.median(rollout_s),
        "tokens_per_step": statistics.median(tokens),
        "rollout_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, rollout_s)),
        "turns": statistics.median(m["env/turns"][k] for k in kept),
        "wall_s": wall,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def summarize(runs: list[dict]) -> list[dict]:
    out = []
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        out.append(
            {"side": side, "runs": len(mine)}
            | {
                k: statistics.median(r[k] for r in mine)
                for k in ("step_s", "rollout_s", "tokens_per_step", "rollout_tokens_per_s", "turns")
            }
        )
    native = out[0]["step_s"]
    for row in out:
        row["x_native"] = row["step_s"] / native
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "runs" / "calculator_sft" / "model"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="1 repeat, 3 steps, earl-tiny-bpe-4l")
    p.add_argument("--out", default=str(RESULTS / "agent_endpoint.csv"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.model = 1, 3, "earl-tiny-bpe-4l"
    data = Path(tempfile.mkdtemp(prefix="calculator_rows_"))
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_calculator.py"), "--out", str(data)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    runs = []
    for r in range(args.repeats):
        for side in list(SIDES) if r % 2 == 0 else list(reversed(SIDES)):
            row = one_run(side, args.model, args.steps, data) | {"repeat": r}
            runs.append(row)
            print(
                f"repeat {r} {side:6s}: step {row['step_s']:.2f} s, rollout {row['rollout_s']:.2f} s, "
                f"{row['rollout_tokens_per_s']:.0f} tok/s (load {row['load_before']:.1f} -> "
                f"{row['load_after']:.1f})",
                flush=True,
            )
    summary = summarize(runs)
    out = Path(args.out)
    cols = ["side", "step_s", "rollout_s", "tokens_per_step", "rollout_tokens_per_s", "turns"]
    write_csv(out, runs, ["repeat", *cols, "wall_s", "load_before", "load_after"])
    write_csv(out.with_name(out.stem + "_summary.csv"), summary, [*cols, "x_native", "runs"])
    print(
        f"\n{'side':7s} {'step s':>7s} {'rollout s':>9s} {'tok/step':>8s} {'rollout tok/s':>13s} {'x native':>8s}"
    )
    for row in summary:
        print(
            f"{row['side']:7s} {row['step_s']:7.2f} {row['rollout_s']:9.2f} {row['tokens_per_step']:8.0f} "
            f"{row['rollout_tokens_per_s']:13.0f} {row['x_native']:8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

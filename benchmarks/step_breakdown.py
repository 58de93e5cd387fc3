"""Where one RL step's time goes, with every shortcut on and with some of them off.

Runs earl_lightning's side of ``benchmarks/vs_trl.py`` (single-turn by default, earl-tiny, fp32,
2 threads, 64 completions of ``--tokens`` tokens in groups of 8, one optimizer step per batch) in
fresh processes, alternating the defaults ("on") with the settings named by ``--off`` turned off
("off"), ``--runs`` times each; reports the median seconds per step and per stage
(``stage/<name>/seconds``) and the rest of the step (logging, metrics, Lightning's loop). Writes
``benchmarks/results/step_breakdown.csv`` (``variant,off,run,rollout,experience,train,
seconds_per_step,outside,guard_s``). With ``--profile``, one more run (defaults) under cProfile
prints the functions that take the most time.

The settings: ``on_policy_shortcut`` (``optim.*``: the old log-probs are the training forward's),
``share_prefix`` (``optim.*``: a group's prompt runs once in the training forward),
``share_prompts`` (``rollout.*``: a group's prompt is prefilled once in the rollout),
``scored_last_layer`` (``optim.*``: the last layer runs only where an action token is scored),
``causal_chunks`` (``optim.*``: on CPU, causal attention in query chunks),
``rms_norm_backward`` (``optim.*``: the RMSNorms' backward written out),
``fused_elementwise`` (``optim.*``: on CPU, the MLPs', norms' and rotary elementwise work compiled).

    python benchmarks/step_breakdown.py --off share_prefix share_prompts   # 3 runs per side, 20 steps
    python benchmarks/step_breakdown.py --off on_policy_shortcut --profile
    python benchmarks/step_breakdown.py --mode multi --off scored_last_layer --runs 3 --steps 8
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl_sides import RESULT_TAG, RunSpec  # noqa: E402
from earl_lightning.parallel.launch_env import standalone_env  # noqa: E402

STAGES = ("rollout", "experience", "train")
SETTINGS = (
    "on_policy_shortcut",
    "share_prefix",
    "share_prompts",
    "scored_last_layer",
    "causal_chunks",
    "rms_norm_backward",
    "fused_elementwise",
)


def one_run(spec: RunSpec) -> dict:
    env = standalone_env()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_trl_sides", json.dumps(asdict(spec))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"earl run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len(RESULT_TAG) :])


def summarize(out: dict, warmup: int) -> dict[str, float]:
    ends, stages = out["ends"], out["stages"][warmup:]
    per_step = (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)
    row = {s: statistics.median(st.get(f"stage/{s}/seconds", 0.0) for st in stages) for s in STAGES}
    row.update(
        seconds_per_step=per_step,
        outside=per_step - sum(row[s] for s in STAGES),
        guard_s=out["guard_s"],
    )
    return row


def profile(spec: RunSpec, top: int = 15) -> None:
    import cProfile
    import pstats

    import torch

    from benchmarks.vs_trl_sides import run_earl

    torch.set_num_threads(spec.threads)
    pr = cProfile.Profile()
    pr.enable()
    run_earl(spec)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=8, help="completion length")
    p.add_argument(
        "--mode", choices=("single", "multi"), default="single", help="multi: 10 turns per episode"
    )
    p.add_argument(
        "--off",
        nargs="+",
        choices=SETTINGS,
        default=["on_policy_shortcut"],
        help="the settings the 'off' side turns off",
    )
    p.add_argument("--profile", action="store_true", help="one more run under cProfile")
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_breakdown.csv"
    )
    a = p.parse_args()
    if a.runs < 1 or a.steps < 4 or a.tokens < 1:
        p.error(f"need --runs >= 1, --steps >= 4, --tokens >= 1; got {vars(a)}")
    turns = 1 if a.mode == "single" else 10
    base = dict(
        side="earl", mode=a.mode, completion_len=a.tokens, turns=turns, steps=a.steps, warmup=2
    )
    rows = []
    for run in range(a.runs):
        for variant in ("on", "off"):  # interleaved, so a noisy neighbour hits both sides alike
            spec = RunSpec(**base, **({k: False for k in a.off} if variant == "off" else {}))
            rows.append(
                dict(
                    variant=variant,
                    off=" ".join(a.off),
                    run=run,
                    **summarize(one_run(spec), warmup=2),
                )
            )
    report(rows, a)
    if a.profile:
        profile(RunSpec(**base))


def report(rows: list[dict], a: argparse.Namespace) -> None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(
        f"{a.mode}-turn, median over {a.runs} runs of {a.steps} steps, {a.tokens}-token completions (seconds); "
        f"off = {' '.join(a.off)} off:"
    )
    print(
        f"{'variant':>8} {'step':>7} "
        + " ".join(f"{s:>10}" for s in (*STAGES, "outside"))
        + f" {'guard':>7}"
    )
    for variant in ("on", "off"):
        sel = [r for r in rows if r["variant"] == variant]
        med = {
            k: statistics.median(r[k] for r in sel)
            for k in ("seconds_per_step", *STAGES, "outside", "guard_s")
        }
        print(
            f"{variant:>8} {med['seconds_per_step']:7.3f} "
            + " ".join(f"{med[s]:10.3f}" for s in (*STAGES, "outside"))
            + f" {med['guard_s']:7.3f}"
        )


if __name__ == "__main__":
    main()

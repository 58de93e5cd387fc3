"""Where one RL step's time goes, with and without the on-policy shortcut (issue 16).

Runs earl_lightning's side of ``benchmarks/vs_trl.py`` (single-turn, earl-tiny, fp32, 2 threads,
64 completions of ``--tokens`` tokens in groups of 8, one optimizer step per batch) in fresh
processes, alternating ``optim.on_policy_shortcut`` true / false, ``--runs`` times each; reports the
median seconds per step and per stage (``stage/<name>/seconds``) and the rest of the step
(logging, metrics, Lightning's loop). Writes ``benchmarks/results/step_breakdown.csv``
(``shortcut,run,seconds_per_step,rollout,experience,train,outside,guard_s``). With ``--profile``,
one more run under cProfile prints the functions that take the most time.

    python benchmarks/step_breakdown.py              # 3 runs per side, 20 steps (about 3 minutes)
    python benchmarks/step_breakdown.py --profile
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import LAUNCHER_VARS  # noqa: E402
from benchmarks.vs_trl_sides import RESULT_TAG, RunSpec  # noqa: E402

STAGES = ("rollout", "experience", "train")


def one_run(spec: RunSpec) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_trl_sides", json.dumps(asdict(spec))], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**env, "PYTHONPATH": str(ROOT)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"earl run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len(RESULT_TAG):])


def summarize(out: dict, warmup: int) -> dict[str, float]:
    ends, stages = out["ends"], out["stages"][warmup:]
    per_step = (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)
    row = {s: statistics.median(st.get(f"stage/{s}/seconds", 0.0) for st in stages) for s in STAGES}
    row.update(seconds_per_step=per_step, outside=per_step - sum(row[s] for s in STAGES), guard_s=out["guard_s"])
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
    p.add_argument("--profile", action="store_true", help="one more run under cProfile")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_breakdown.csv")
    a = p.parse_args()
    if a.runs < 1 or a.steps < 4 or a.tokens < 1:
        p.error(f"need --runs >= 1, --steps >= 4, --tokens >= 1; got {vars(a)}")
    rows = []
    for run in range(a.runs):
        for shortcut in (True, False):  # interleaved, so a noisy neighbour hits both sides alike
            spec = RunSpec(side="earl", mode="single", completion_len=a.tokens, turns=1, steps=a.steps, warmup=2,
                           on_policy_shortcut=shortcut)
            rows.append(dict(shortcut=shortcut, run=run, **summarize(one_run(spec), warmup=2)))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"median over {a.runs} runs of {a.steps} steps, {a.tokens}-token completions (seconds):")
    print(f"{'shortcut':>9} {'step':>7} " + " ".join(f"{s:>10}" for s in (*STAGES, "outside")))
    for shortcut in (True, False):
        sel = [r for r in rows if r["shortcut"] == shortcut]
        med = {k: statistics.median(r[k] for r in sel) for k in ("seconds_per_step", *STAGES, "outside")}
        print(f"{str(shortcut):>9} {med['seconds_per_step']:7.3f} " +
              " ".join(f"{med[s]:10.3f}" for s in (*STAGES, "outside")))
    if a.profile:
        profile(RunSpec(side="earl", mode="single", completion_len=a.tokens, turns=1, steps=a.steps, warmup=2))


if __name__ == "__main__":
    main()

"""Compare seeds.py outputs seed by seed: one row per seed and run, from each run's TensorBoard log.

    python scripts/compare_runs.py --runs off=docs/experiments/results/addition_dynamic_sampling_off \
        k4=docs/experiments/results/addition_dynamic_sampling_k4 --seeds 0 1 2 --threshold 0.95 \
        --out docs/experiments/results/addition_dynamic_sampling.csv

A row: the held-out evaluation (``--metric``) before and after; the evaluation step at which it
first reached ``--threshold``, the seconds from the first evaluation to that one (the evaluations
included: every run evaluates at the same steps) and the episodes played until then (a step with
dynamic sampling plays ``dynamic_sampling/groups_drawn`` groups, not ``batch_size / group_size``);
the training reward (``reward/mean``, the step's first draw) over the last ``--last`` steps; the
share of zero-spread groups (``reward/zero_std_groups``) over the first and the last ``--last``
steps; ``logprob/mismatch`` and ``rollout_correction/*`` over the run (mean, and the extreme); the
``dynamic_sampling/*`` totals; the median seconds between two training steps (a step with an
evaluation inside is above the median, so it does not count) and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml
from _rows import report_rows

Points = list[tuple[int, float, float]]  # (step, wall time, value)


def scalars(run: Path) -> dict[str, Points]:
    """Every scalar of the run's latest TensorBoard log (a resumed run's last), by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(run.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not events:
        raise SystemExit(f"error: no TensorBoard log under {run}")
    acc = EventAccumulator(str(events[-1].parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        t: [(e.step, e.wall_time, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]
    }


def step_episodes(s: dict[str, Points], config: dict) -> dict[int, float]:
    """Episodes each training step played: every draw's groups when dynamic sampling is on."""
    group_size = config["data"].get("group_size") or 1
    if "dynamic_sampling/groups_drawn" in s:
        return {step: v * group_size for step, _, v in s["dynamic_sampling/groups_drawn"]}
    return {step: float(config["data"]["batch_size"]) for step, _, _ in s["reward/mean"]}


def reached(evals: Points, threshold: float, episodes: dict[int, float]) -> dict[str, float | None]:
    """The first evaluation at or above ``threshold``: its step, seconds since the first, episodes."""
    first = next(((step, t) for step, t, v in evals if v >= threshold - 1e-9), None)
    if first is None:
        return {
            "steps_to_threshold": None,
            "seconds_to_threshold": None,
            "episodes_to_threshold": None,
        }
    step, t = first
    return {
        "steps_to_threshold": step,
        "seconds_to_threshold": round(t - evals[0][1]),
        "episodes_to_threshold": round(sum(v for k, v in episodes.items() if k < step)),
    }


def over(points: Points, how: str) -> float | None:
    if not points:
        return None
    values = [v for _, _, v in points]
    return {"mean": statistics.fmean, "max": max, "min": min}[how](values)


def one_run(label: str, root: Path, args: argparse.Namespace) -> dict:
    run = root / "rl"
    s = scalars(run)
    config = yaml.safe_load(sorted(run.rglob("config.yaml"))[-1].read_text())
    evals = s[args.metric]
    row: dict = {
        "run": label,
        "start": evals[0][2],
        "final": evals[-1][2],
        "final_step": evals[-1][0],
    }
    row.update(reached(evals, args.threshold, step_episodes(s, config)))
    reward, zero = s["reward/mean"], s.get("reward/zero_std_groups", [])
    row["reward_last"] = over(reward[-args.last :], "mean")
    row["zero_std_first"] = over(zero[: args.last], "mean")
    row["zero_std_last"] = over(zero[-args.last :], "mean")
    mismatch = s.get("logprob/mismatch", [])
    row.update(mismatch_mean=over(mismatch, "mean"), mismatch_max=over(mismatch, "max"))
    for name, how in (("weight_mean", "mean"), ("weight_min", "min"), ("weight_max", "max")):
        row[name] = over(s.get(f"rollout_correction/{name}", []), how)
    row["outside_share"] = over(s.get("rollout_correction/outside_share", []), "mean")
    for name in ("draws", "groups_drawn", "groups_dropped"):
        points = s.get(f"dynamic_sampling/{name}", [])
        row[f"ds_{name}"] = sum(v for _, _, v in points) if points else None
    walls = [t for _, t, _ in reward]
    row["s_per_step"] = statistics.median(b - a for a, b in zip(walls, walls[1:]))
    record = root / "record.json"
    row["rl_wall_s"] = json.loads(record.read_text())["rl_wall_s"] if record.is_file() else None
    # the weights to 8 digits: in float32 they differ from 1 in the sixth
    return {k: _round(k, v) for k, v in row.items()}


def _round(key: str, value: object) -> object:
    if not isinstance(value, float):
        return value
    return float(f"{value:.8g}" if key.startswith("weight_") else f"{value:.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, metavar="LABEL=DIR")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--metric", default="val/rewards/accuracy_reward")
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--last", type=int, default=10, help="steps averaged at the end")
    parser.add_argument("--out", type=Path, default=None, help="the rows as CSV")
    args = parser.parse_args()
    runs = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            raise SystemExit(
                f"error: `--runs` {item!r} is not LABEL=DIR with DIR a seeds.py output"
            )
        runs.append((label, Path(path)))
    rows = [
        {"seed": seed, **one_run(label, path / f"seed{seed}", args)}
        for seed in args.seeds
        for label, path in runs
    ]
    report_rows(rows, args.out)


if __name__ == "__main__":
    main()

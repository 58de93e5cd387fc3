"""Turn a run's TensorBoard scalars into a PNG learning curve (and a CSV of the same numbers).

python scripts/plot_learning_curve.py runs/connect4_grpo/lightning_logs/version_0 --out docs/experiments/results/learning_curve.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

TRAIN_TAGS = ("reward/mean", "env/win_rate", "env/invalid_rate")
EVAL_TAGS = ("val/win_rate", "val/draw_rate", "val/invalid_rate")


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(Path(logdir).glob("events.out.tfevents.*")):
        raise SystemExit(f"error: no TensorBoard event file in {logdir!r}")
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}


def default_title(logdir: Path) -> str:
    """'earl_lightning: <estimator> + <loss> (<model>)' from the run's saved hyperparameters, when present."""
    import yaml

    hp_file = logdir / "hparams.yaml"
    hp = (yaml.safe_load(hp_file.read_text()) or {}) if hp_file.exists() else {}
    algo = hp.get("algorithm")
    if not isinstance(algo, dict) or "advantage" not in algo:
        return "earl_lightning learning curve"
    loss = (algo.get("loss") or {}).get("name", "ppo_clip")
    return f"earl_lightning: {algo['advantage']['name']} + {loss} ({hp.get('model', '?')})"


def plot(scalars: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for tag in TRAIN_TAGS:
        if tag in scalars:
            steps, values = zip(*scalars[tag])
            a.plot(steps, values, label=tag, lw=1)
    a.set_xlabel("RL step")
    a.set_title("training episodes")
    a.legend()
    a.grid(alpha=0.3)
    for tag in EVAL_TAGS:
        if tag in scalars:
            steps, values = zip(*sorted(scalars[tag]))
            b.plot(steps, values, marker="o", label=tag)
    b.axhline(0.65, color="grey", ls="--", lw=0.8, label="target win rate 0.65")
    b.axhline(0.05, color="grey", ls=":", lw=0.8, label="target invalid rate 0.05")
    b.set_xlabel("RL step")
    b.set_ylim(-0.02, 1.02)
    b.set_title("greedy eval, 128 fixed seeds")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("logdir", help="a TensorBoard run directory (lightning_logs/version_N)")
    p.add_argument("--out", default="docs/experiments/results/learning_curve.png")
    p.add_argument(
        "--title", default=None, help="default: the run's algorithm and model (from hparams.yaml)"
    )
    args = p.parse_args()
    scalars = read_scalars(args.logdir)
    out = Path(args.out)
    plot(scalars, out, args.title or default_title(Path(args.logdir)))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag", "step", "value"])
        for tag in (*TRAIN_TAGS, *EVAL_TAGS):
            for step, value in scalars.get(tag, []):
                w.writerow([tag, step, value])
    for tag in EVAL_TAGS:
        if tag in scalars:
            print(tag, " ".join(f"{s}:{v:.3f}" for s, v in sorted(scalars[tag])))
    print(f"wrote {out} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()

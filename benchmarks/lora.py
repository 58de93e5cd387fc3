"""LoRA (``--model.peft``) against full fine-tuning on the same recipe: peak memory and step time
(issue 44, item 1).

The recipe: GRPO on Connect Four against a random opponent, legal columns only, a KL term
(``kl.coef`` 0.05: full fine-tuning loads a second, frozen copy as the reference; LoRA runs the
same model with its adapters off), AdamW. Each trial is a fresh process that fits ``--steps`` RL
iterations, so its peak RSS is its own; the two sides alternate (full, lora, full, lora, ...) for
``--repeats`` rounds, and the table gives medians over the rounds. Per trial:

- ``step_s``: the median wall time of an RL iteration (rollout + experience + train), the first
  one left out (warm-up);
- ``peak_rss_mib``: the process's peak resident memory (``ru_maxrss``; imports included, the same
  for both sides); on a GPU also ``cuda_peak_mib`` (``torch.cuda.max_memory_allocated``);
- ``state_mib``: what training holds for the model after the last step: parameters (and the
  reference copy), gradients and the optimizer's state;
- ``trainable``: parameters the optimizer updates;
- ``load``: the 1-minute load average when the trial started (other work on the machine).

    python benchmarks/lora.py                 # earl-tiny-100m, 6 steps, 3 rounds
    python benchmarks/lora.py --quick         # earl-tiny, 3 steps, 2 rounds (a smoke figure)

Writes ``benchmarks/results/lora.csv`` (``--quick``: ``lora_quick.csv``), one row per trial.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
LORA = {"r": 16, "alpha": 32.0, "target_modules": "all-linear"}
SIDES = ("full", "lora")
FIELDS = ("side", "round", "step_s", "peak_rss_mib", "cuda_peak_mib", "state_mib", "trainable", "load")


class StepClock:
    """Lightning callback: the wall time of each training step (one RL iteration)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.seconds.append(time.perf_counter() - self._t0)


def state_bytes(module, optimizer) -> int:
    """Parameters (policy, reference copy, value head), their gradients and the optimizer's state."""
    import torch

    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def trial(side: str, model: str, steps: int, batch: int, threads: int) -> dict:
    """One fit in this process; its measurements."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from earl_lightning.data.datamodule import EpisodeDataModule
    from earl_lightning.modules import AgenticRLModule

    torch.set_num_threads(threads)
    module = AgenticRLModule(
        model=model, transcript_every_n_steps=0, peft=LORA if side == "lora" else None,
        rollout={"max_turns": 21, "max_context_tokens": 1024,
                 "sampling": {"max_new_tokens": 1, "allowed_tokens": list("0123456")}},
        algorithm={"advantage": {"name": "grpo"}, "kl": {"coef": 0.05}}, optim={"lr": 1e-4})
    data = EpisodeDataModule(env="connect_four", env_kwargs={"opponent": "random"}, batch_size=batch,
                             group_size=4, eval_episodes=0)
    clock = type("Clock", (StepClock, Callback), {})()
    gpu = torch.cuda.is_available()
    trainer = L.Trainer(max_steps=steps, accelerator="gpu" if gpu else "cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[clock])
    trainer.fit(module, data)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"step_s": statistics.median(clock.seconds[1:] or clock.seconds), "peak_rss_mib": rss_kib / 1024,
            "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if gpu else 0.0,
            "state_mib": state_bytes(module, trainer.optimizers[0]) / 2**20,
            "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}


def run_trial(side: str, rnd: int, args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--trial", side, "--model", args.model, "--steps", str(args.steps),
           "--batch", str(args.batch), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{side} trial failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"side": side, "round": rnd, **result, "load": load}


def summary(rows: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        out.append((side, {k: statistics.median(r[k] for r in mine) for k in FIELDS[2:]}))
    return out


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.model}, {args.steps} steps x {args.batch} episodes, {args.repeats} rounds, "
          f"{args.threads} threads, {os.cpu_count()} CPUs; medians over rounds")
    print(f"{'side':<6}{'step_s':>10}{'peak_rss_mib':>14}{'cuda_peak_mib':>15}{'state_mib':>11}{'trainable':>12}"
          f"{'load':>7}")
    for side, m in summary(rows):
        print(f"{side:<6}{m['step_s']:>10.3f}{m['peak_rss_mib']:>14.0f}{m['cuda_peak_mib']:>15.0f}"
              f"{m['state_mib']:>11.1f}{m['trainable']:>12.0f}{m['load']:>7.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="earl-tiny, 3 steps, 2 rounds (a smoke figure)")
    p.add_argument("--model", default=None, help="model preset or path (default earl-tiny-100m)")
    p.add_argument("--steps", type=int, default=None, help="RL iterations per trial (default 6)")
    p.add_argument("--repeats", type=int, default=None, help="rounds of (full, lora) (default 3)")
    p.add_argument("--batch", type=int, default=16, help="episodes per RL iteration")
    p.add_argument("--threads", type=int, default=2, help="torch threads per trial")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--trial", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = args.model or ("earl-tiny" if args.quick else "earl-tiny-100m")
    args.steps = args.steps or (3 if args.quick else 6)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.trial:  # a child: one fit, its measurements as the last line of stdout
        print(json.dumps(trial(args.trial, args.model, args.steps, args.batch, args.threads)))
        return
    rows = [run_trial(side, rnd, args) for rnd in range(args.repeats) for side in SIDES]
    out = args.out or ROOT / "benchmarks" / "results" / ("lora_quick.csv" if args.quick else "lora.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*FIELDS, "model", "steps", "batch", "threads"])
        writer.writeheader()
        writer.writerows({**r, "model": args.model, "steps": args.steps, "batch": args.batch,
                          "threads": args.threads} for r in rows)
    print_table(rows, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

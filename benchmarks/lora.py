"""LoRA (``--model.peft``) against full fine-tuning on the same recipe: peak memory and step time
(issue 44, item 1).

The recipe: GRPO on Connect Four against a random opponent, legal columns only, a KL term
(``kl.coef`` 0.05: full fine-tuning loads a second, frozen copy as the reference; LoRA runs the
same model with its adapters off), AdamW. Each trial is a fresh process that fits ``--steps`` RL
iterations, so its peak RSS is its own; the two sides alternate (full, lora, full, lora, ...) for
``--repeats`` rounds, and the table gives medians over the rounds and their ratios (lora / full).
Per trial:

- ``step_s``: the median wall time of an RL iteration (rollout + experience + train), the first
  one left out (warm-up); ``rollout_s``, ``experience_s``, ``train_s``: its stages (the module's
  ``stage/*/seconds``);
- ``peak_rss_mib``: the process's peak resident memory (``ru_maxrss``; imports included, the same
  for both sides); on a GPU also ``cuda_peak_mib`` (``torch.cuda.max_memory_allocated``);
- ``state_mib``: what training holds for the model after the last step: the module's parameters
  (the policy; the frozen base and the adapters under LoRA), any gradients still held and the
  optimizer's state;
- ``trainable``: parameters the optimizer updates;
- ``tokens``, ``context_max``: tokens of a step's experience, the longest sequence;
- ``load``: the 1-minute load average when the trial started (other work on the machine).

The default model is ``earl-tiny-100m``'s widths (hidden 768, MLP 2816, 12 heads, 4 KV heads)
with 2 layers (~17 M parameters) and micro-batches of 4096 padded tokens: the full 12-layer
preset at the default 16,384-token micro-batch holds ~14 GB of activations for backward (about
860 KB per token: 12 layers x ~18k saved floats) and took ~7 min per step on 2 busy cores.

    python benchmarks/lora.py                 # 100m widths, 2 layers, 4 steps, 3 rounds (~45 min under load 6)
    python benchmarks/lora.py --layers 0      # the whole earl-tiny-100m preset (12 layers)
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
DEFAULT = {
    "model": "earl-tiny-100m",
    "layers": 2,
    "steps": 4,
    "repeats": 3,
    "batch": 16,
    "micro_batch_tokens": 4096,
}
QUICK = {
    "model": "earl-tiny",
    "layers": 0,
    "steps": 3,
    "repeats": 2,
    "batch": 16,
    "micro_batch_tokens": 16384,
}
FIELDS = (
    "side",
    "round",
    "step_s",
    "rollout_s",
    "experience_s",
    "train_s",
    "step_s_per_ktok",
    "train_s_per_ktok",
    "peak_rss_mib",
    "cuda_peak_mib",
    "state_mib",
    "trainable",
    "tokens",
    "context_max",
    "load",
)
STAGES = ("rollout", "experience", "train")
RATIOS = (
    "step_s",
    "rollout_s",
    "experience_s",
    "train_s",
    "step_s_per_ktok",
    "train_s_per_ktok",
    "peak_rss_mib",
    "cuda_peak_mib",
    "state_mib",
    "trainable",
)


class StepClock:
    """Lightning callback: the wall time of each training step (one RL iteration), its stages' times
    and its tokens (the module's own ``stage/*/seconds`` and ``tokens/total`` metrics)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.stages: dict[str, list[float]] = {name: [] for name in STAGES}
        self.tokens: list[float] = []
        self.context_max: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seconds.append(time.perf_counter() - self._t0)
        metrics = trainer.callback_metrics
        for name in STAGES:
            self.stages[name].append(float(metrics.get(f"stage/{name}/seconds", float("nan"))))
        self.tokens.append(float(metrics.get("tokens/total", float("nan"))))
        self.context_max.append(float(metrics.get("context/max", float("nan"))))


def state_bytes(module, optimizer) -> int:
    """Parameters (policy, reference copy, value head), their gradients and the optimizer's state."""
    import torch

    tensors = [p for p in module.parameters()] + [
        p.grad for p in module.parameters() if p.grad is not None
    ]
    tensors += [
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def trial(
    side: str, model: str, steps: int, batch: int, threads: int, micro_batch_tokens: int
) -> dict:
    """One fit in this process; its measurements."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule

    torch.set_num_threads(threads)
    module = AgenticRLModule(
        model=model,
        transcripts={"every_n_steps": 0},
        peft=LORA if side == "lora" else None,
        rollout={
            "max_turns": 21,
            "max_context_tokens": 1024,
            "sampling": {"max_new_tokens": 1, "allowed_tokens": list("0123456")},
        },
        algorithm={"advantage": {"name": "grpo"}, "kl": {"coef": 0.05}},
        optim={"lr": 1e-4, "micro_batch_tokens": micro_batch_tokens},
    )
    data = EpisodeDataModule(
        env="connect_four",
        env_kwargs={"opponent": "random"},
        batch_size=batch,
        group_size=4,
        eval_episodes=0,
    )
    clock = type("Clock", (StepClock, Callback), {})()
    gpu = torch.cuda.is_available()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(module, data)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def steady(values: list[float]) -> float:  # the first step left out (warm-up)
        return statistics.median(values[1:] or values)

    # the two sides' policies differ after the first update, and so do their games' lengths: per
    # 1000 experience tokens too
    per_ktok = {
        f"{k}_per_ktok": steady([t / n * 1000 for t, n in zip(v, clock.tokens)])
        for k, v in (("step_s", clock.seconds), ("train_s", clock.stages["train"]))
    }
    return {
        "step_s": steady(clock.seconds),
        **{f"{name}_s": steady(clock.stages[name]) for name in STAGES},
        **per_ktok,
        "tokens": steady(clock.tokens),
        "context_max": max(clock.context_max),
        "peak_rss_mib": rss_kib / 1024,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if gpu else 0.0,
        "state_mib": state_bytes(module, trainer.optimizers[0]) / 2**20,
        "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
    }


def run_trial(side: str, rnd: int, args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    cmd = [
        sys.executable,
        __file__,
        "--trial",
        side,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--micro-batch-tokens",
        str(args.micro_batch_tokens),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{side} trial failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"side": side, "round": rnd, **result, "load": load}


def summary(rows: list[dict]) -> dict[str, dict]:
    return {
        side: {k: statistics.median(r[k] for r in rows if r["side"] == side) for k in FIELDS[2:]}
        for side in SIDES
    }


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    med = summary(rows)
    print(
        f"\n{args.label}: {args.steps} steps x {args.batch} episodes, micro-batch {args.micro_batch_tokens} "
        f"tokens, {args.repeats} rounds, {args.threads} threads, {os.cpu_count()} CPUs; medians over rounds"
    )
    cols = [k for k in FIELDS[2:] if k != "cuda_peak_mib" or med["full"][k]]
    print(f"{'side':<11}" + "".join(f"{k:>17}" for k in cols))
    for side in SIDES:
        print(f"{side:<11}" + "".join(f"{med[side][k]:>17.4g}" for k in cols))
    ratio = paired_ratios(rows)
    print(
        f"{'lora/full':<11}"
        + "".join(f"{ratio[k]:>17.3f}" if k in ratio else f"{'':>17}" for k in cols)
    )
    print(
        "lora/full: the median over rounds of each round's ratio (the two sides of a round ran back to back)"
    )


def paired_ratios(rows: list[dict]) -> dict[str, float]:
    """Per figure, the median over rounds of (lora / full) within the round."""
    out = {}
    for k in RATIOS:
        pairs = [
            (
                next(r[k] for r in rows if r["side"] == "lora" and r["round"] == rnd),
                next(r[k] for r in rows if r["side"] == "full" and r["round"] == rnd),
            )
            for rnd in sorted({r["round"] for r in rows})
        ]
        if all(full for _, full in pairs):
            out[k] = statistics.median(lora / full for lora, full in pairs)
    return out


def resolve_model(args: argparse.Namespace) -> None:
    """``--layers`` builds the preset with that many layers (once, here: the trials find it cached)."""
    args.label = args.model if args.layers is None else f"{args.model} with {args.layers} layers"
    if args.layers is not None:
        from earl_lightning.models.tiny import make_tiny_model

        args.model = str(make_tiny_model(args.model, num_hidden_layers=args.layers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="earl-tiny, 3 steps, 2 rounds (a smoke figure)"
    )
    p.add_argument(
        "--model", default=None, help=f"model preset or path (default {DEFAULT['model']})"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"build the preset with this many layers (default {DEFAULT['layers']}; 0: the preset's own)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"RL iterations per trial (default {DEFAULT['steps']})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"rounds of (full, lora) (default {DEFAULT['repeats']})",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"episodes per RL iteration (default {DEFAULT['batch']})",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help=f"padded tokens per forward/backward (default {DEFAULT['micro_batch_tokens']})",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per trial (1: the machine is shared)"
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--trial", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    defaults = QUICK if args.quick else DEFAULT
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.layers == 0:
        args.layers = None
    if args.trial:  # a child: one fit, its measurements as the last line of stdout
        print(
            json.dumps(
                trial(
                    args.trial,
                    args.model,
                    args.steps,
                    args.batch,
                    args.threads,
                    args.micro_batch_tokens,
                )
            )
        )
        return
    resolve_model(args)
    rows = []
    for rnd in range(args.repeats):
        for side in SIDES:
            rows.append(run_trial(side, rnd, args))
            r = rows[-1]
            print(
                f"round {rnd} {side}: step {r['step_s']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                f"state {r['state_mib']:.1f} MiB, load {r['load']:.2f}",
                flush=True,
            )
    out = args.out or ROOT / "benchmarks" / "results" / (
        "lora_quick.csv" if args.quick else "lora.csv"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=[*FIELDS, "model", "steps", "batch", "micro_batch_tokens", "threads"]
        )
        writer.writeheader()
        writer.writerows(
            {
                **r,
                "model": args.label,
                "steps": args.steps,
                "batch": args.batch,
                "micro_batch_tokens": args.micro_batch_tokens,
                "threads": args.threads,
            }
            for r in rows
        )
    print_table(rows, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

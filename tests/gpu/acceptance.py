"""The measuring parts of ``tests/gpu/acceptance.sh`` (one part per process):

    python -m tests.gpu.acceptance fit --backend hf|vllm --out DIR   # bf16 fit, stage figures, memory model
    python -m tests.gpu.acceptance oom --out DIR                     # a real CUDA OOM, recovered

The model is Qwen2.5-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864)
with random weights and the char-level tokenizer (``make_tiny_model`` overrides; ~358M parameters),
trained in bf16 on ``recall`` episodes. ``--device cpu --preset earl-tiny`` is the dry run that
checks the plumbing on a machine without a GPU (fp32, no memory figures, an emulated OOM).

Every stage runs inside :class:`MeasuredStrategy` (``EarlStrategy`` that records the stage's
layout, its stats and ``torch.cuda.max_memory_allocated``), so each stage's peak is compared with
the memory model's prediction for the same layout and the same step's statistics, and each stage's
seconds with ``earl plan``'s time model on the GPU's device profile (``plan_errors_<backend>.csv``;
the CPU profile in the dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from earl_lightning.callbacks import AdaptiveParallelism
from earl_lightning.callbacks.adaptive_setup import memory_model_of
from earl_lightning.models import make_tiny_model, resolve_model_path
from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.views import exactly_on_policy
from earl_lightning.parallel.hardware import Cluster, device_profile, profile_for_gpu
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.memory import MemoryModel
from earl_lightning.parallel.throughput import layout_key
from earl_lightning.parallel.timing import TimeModel
from earl_lightning.strategies import EarlStrategy

SHAPE_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
MIB = 2**20
STAGE_KEYS = ("rollout", "experience", "train")
OOM_BIG, OOM_SMALL = 32768, 2048  # micro-batch token budgets the OOM part chooses between


def model_path(preset: str) -> str:
    if preset == "qwen2.5-0.5b-shape":
        return str(make_tiny_model("earl-tiny", **SHAPE_05B))
    return resolve_model_path(preset)


class MeasuredStrategy(EarlStrategy):
    """``EarlStrategy`` that records, per stage attempt, the layout, the micro-batch budget, the
    stats and the peak of ``torch.cuda.max_memory_allocated`` (CUDA only). With ``cap_train``
    the train stage runs under a per-process memory cap (``set_per_process_memory_fraction``)
    halfway, geometrically, between the memory model's predictions for the ``OOM_SMALL`` and
    ``OOM_BIG`` micro-batches: the big one fails in the CUDA allocator, the small one fits."""

    def __init__(self, *args: Any, cap_train: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, Any]] = []
        self.cap_train, self.caps = cap_train, []

    @contextlib.contextmanager
    def stage(self, name: str, stats: Mapping[str, Any] | None = None) -> Iterator[Any]:
        cuda = self.root_device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        rec = {
            "stage": name,
            "step": self.lightning_module.rl_iteration,
            "stats": dict(stats or {}),
            "ok": False,
            "before_mib": torch.cuda.memory_allocated() / MIB if cuda else math.nan,
        }
        self.records.append(rec)
        try:
            with super().stage(name, stats) as ctx:
                rec["layout"] = Layout(
                    ctx.layout.dp,
                    ctx.layout.tp,
                    ctx.budget(self.lightning_module.optim_config.micro_batch_tokens),
                    ctx.layout.activation_checkpointing,
                )
                if name == "train" and self.cap_train and cuda:
                    self._cap(rec["stats"])
                yield ctx
            rec["ok"] = True
        finally:
            if cuda:
                torch.cuda.synchronize()
                rec["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
                torch.cuda.set_per_process_memory_fraction(1.0)
            else:
                rec["peak_mib"] = math.nan

    def _cap(self, stats: dict) -> None:
        model = memory_model(self.lightning_module)
        s = {**stats, "gen_len": 0}
        small, big = (
            model.estimate("train", Layout(1, 1, m), s).total for m in (OOM_SMALL, OOM_BIG)
        )
        if big < 2 * small:
            raise RuntimeError(
                f"the OOM workload is too small: train predicted {small / MIB:.0f} MiB with "
                f"{OOM_SMALL} tokens, {big / MIB:.0f} MiB with {OOM_BIG}; the cap needs a 2x gap"
            )
        cap = math.sqrt(small * big)
        total = torch.cuda.get_device_properties(self.root_device).total_memory
        torch.cuda.empty_cache()  # cached blocks of the rollout would count against the cap
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.root_device)
        self.caps.append({"small_mib": small / MIB, "big_mib": big / MIB, "cap_mib": cap / MIB})


def memory_model(module: AgenticRLModule) -> MemoryModel:
    """The memory model AdaptiveParallelism (and ``earl plan``) builds for this module."""
    return memory_model_of(
        module.policy.config,
        str(next(module.policy.parameters()).dtype),
        "adamw",
        module.workload,
        resident_train_state=next(module.policy.parameters()).is_cuda,
    )


def time_model(module: AgenticRLModule) -> TimeModel | None:
    """``earl plan``'s time model on this device's profile (None: no profile describes it)."""
    cuda = next(module.policy.parameters()).is_cuda
    name = profile_for_gpu(torch.cuda.get_device_name()) if cuda else "CPU"
    if name is None:
        print(f"plan: no device profile for {torch.cuda.get_device_name()}: times not predicted")
        return None
    r, a, o = module.rollout_config, module.algorithm_config, module.optim_config
    return TimeModel(
        memory_model(module),
        Cluster(1, 1, device_profile(name)),
        turns=r.max_turns,
        ppo_epochs=o.ppo_epochs,
        optimizer_steps=o.ppo_epochs * o.mini_batches,
        experience_forwards=int(not exactly_on_policy(r, a, o)) + int(a.kl.coef > 0),
    )


class StepLog(L.Callback):
    """The logged figures of every RL step (``trainer.callback_metrics``)."""

    NAMES = (
        "reward/mean",
        "logprob/mismatch",
        "tokens/generated",
        "context/mean",
        "oom/recoveries",
        *(f"stage/{s}/{k}" for s in STAGE_KEYS for k in ("seconds", "tokens_per_s")),
    )

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.rows.append(
            {"step": len(self.rows), **{k: float(m[k]) if k in m else math.nan for k in self.NAMES}}
        )


def build(
    args: argparse.Namespace, backend: str, batch: int, turns: int, mbt: int
) -> tuple[AgenticRLModule, Any]:
    cuda = args.device == "cuda"
    module = AgenticRLModule(
        model=model_path(args.preset),
        dtype="bfloat16" if cuda else "float32",
        seed=0,
        transcripts={"every_n_steps": 0},
        logprob_mismatch_warn=1.0,  # bf16: recorded, not warned about
        rollout={
            "backend": backend,
            "max_turns": turns,
            "max_context_tokens": 2048,
            "sampling": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
        },
        algorithm={
            "advantage": {"name": "grpo"},
            "loss": {"name": "ppo_clip", "aggregation": "token_mean"},
        },
        optim={"lr": 1e-5, "micro_batch_tokens": mbt},
    )
    data = EpisodeDataModule(
        env="recall",
        env_kwargs={"num_turns": turns, "padding_chars": 48},
        batch_size=batch,
        group_size=8,
        eval_episodes=0,
    )
    return module, data


def trainer_for(
    args: argparse.Namespace, strategy: EarlStrategy, callbacks: list, steps: int
) -> L.Trainer:
    return L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        callbacks=callbacks,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(args.out / "lightning"),
    )


def memory_rows(module: AgenticRLModule, records: list[dict]) -> list[dict]:
    """Measured peak vs predicted per stage attempt; rollout is predicted from the step's final
    contexts (what the experience stage sees), as AdaptiveParallelism does from the last step."""
    model = memory_model(module)
    ctx = {
        r["step"]: r["stats"]
        for r in records
        if r["stage"] == "experience" and "context_max" in r["stats"]
    }
    gen = module.rollout_config.sampling.max_new_tokens
    rows = []
    for r in records:
        stats = ctx.get(r["step"])
        if stats is None or "layout" not in r:
            continue
        est = model.estimate(r["stage"], r["layout"], {**stats, "gen_len": gen}).total / MIB
        err = (
            100 * (est - r["peak_mib"]) / r["peak_mib"]
            if r["peak_mib"] == r["peak_mib"]
            else math.nan
        )
        rows.append(
            {
                "step": r["step"],
                "stage": r["stage"],
                "layout": layout_key(r["layout"]),
                "ok": r["ok"],
                "allocated_before_mib": r["before_mib"],
                "measured_peak_mib": r["peak_mib"],
                "predicted_mib": est,
                "error_pct": err,
            }
        )
    return rows


def plan_rows(module: AgenticRLModule, records: list[dict], steps: list[dict]) -> list[dict]:
    """``earl plan``'s predictions against this run, per stage of every step after the first
    (which pays for warm-up): the stage's seconds and peak memory, each with its error. A stage
    is predicted from its step's final contexts (the experience stage's statistics)."""
    model = time_model(module)
    memory = {(m["step"], m["stage"]): m for m in memory_rows(module, records)}
    ctx = {r["step"]: r["stats"] for r in records if r["stage"] == "experience" and r["ok"]}
    gen = module.rollout_config.sampling.max_new_tokens
    rows = []
    for r in records:
        step, stage = r["step"], r["stage"]
        if step == 0 or not r["ok"] or step not in ctx or step >= len(steps):
            continue
        measured = steps[step][f"stage/{stage}/seconds"]
        predicted = (
            model.seconds(stage, r["layout"], {**ctx[step], "gen_len": gen}) if model else math.nan
        )
        mem = memory.get((step, stage), {})
        rows.append(
            {
                "step": step,
                "stage": stage,
                "layout": layout_key(r["layout"]),
                "measured_s": measured,
                "predicted_s": predicted,
                "time_error_pct": 100 * (predicted / measured - 1) if measured else math.nan,
                "measured_peak_mib": mem.get("measured_peak_mib", math.nan),
                "predicted_mib": mem.get("predicted_mib", math.nan),
                "memory_error_pct": mem.get("error_pct", math.nan),
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        raise RuntimeError(f"nothing to write to {path}")
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(
            {k: f"{v:.5g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )
    print(f"wrote {path}")


def fit(args: argparse.Namespace) -> None:
    module, data = build(args, args.backend, batch=64, turns=4, mbt=8192)
    strategy = MeasuredStrategy(process_group_backend="nccl" if args.device == "cuda" else "gloo")
    log = StepLog()
    trainer_for(args, strategy, [log], args.steps).fit(module, data)
    write_csv(
        args.out / f"fit_{args.backend}.csv", [{"backend": args.backend, **r} for r in log.rows]
    )
    write_csv(args.out / f"memory_{args.backend}.csv", memory_rows(module, strategy.records))
    plan = plan_rows(module, strategy.records, log.rows)
    write_csv(args.out / f"plan_errors_{args.backend}.csv", plan)
    for s in STAGE_KEYS:
        errs = sorted(abs(r["time_error_pct"]) for r in plan if r["stage"] == s)
        mems = sorted(abs(r["memory_error_pct"]) for r in plan if r["stage"] == s)
        print(
            f"{args.backend} plan {s}: |time error| median {errs[len(errs) // 2]:.0f}%, "
            f"|memory error| median {mems[len(mems) // 2]:.0f}%"
        )
    timed = log.rows[1:] or log.rows  # the first step pays for CUDA / engine warm-up
    for s in STAGE_KEYS:
        tps = sorted(r[f"stage/{s}/tokens_per_s"] for r in timed)
        print(f"{args.backend} {s}: median {tps[len(tps) // 2]:.0f} tokens/s")
    print(
        f"{args.backend} logprob/mismatch per step: {[round(r['logprob/mismatch'], 5) for r in log.rows]}"
    )
    if len(log.rows) != args.steps:
        raise SystemExit(f"fit ran {len(log.rows)} of {args.steps} steps")


@contextlib.contextmanager
def emulated_oom(strategy: EarlStrategy) -> Iterator[None]:
    """CPU dry run only: the train stage under the big micro-batch raises MemoryError (the CPU
    allocator's error type), so the recovery plumbing runs without a GPU's allocator limit."""
    from earl_lightning.modules import rl

    real = rl.ppo_update

    def update(*a: Any, **kw: Any) -> Any:
        if strategy.current_layout.micro_batch_tokens == OOM_BIG:
            raise MemoryError("emulated: out of memory under the big micro-batch (CPU dry run)")
        return real(*a, **kw)

    rl.ppo_update = update
    try:
        yield
    finally:
        rl.ppo_update = real


def oom(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    module, data = build(args, "hf", batch=32, turns=3, mbt=OOM_BIG)
    strategy = MeasuredStrategy(process_group_backend="nccl" if cuda else "gloo", cap_train=True)
    # The selector sees the whole GPU as its budget, so it tries the big micro-batch first.
    budget = torch.cuda.get_device_properties(0).total_memory if cuda else 64 * 2**30
    cb = AdaptiveParallelism(memory_budget_bytes=budget, micro_batch_tokens=[OOM_BIG, OOM_SMALL])
    log = StepLog()
    with contextlib.nullcontext() if cuda else emulated_oom(strategy):
        trainer_for(args, strategy, [cb, log], args.steps).fit(module, data)
    train = [r for r in strategy.records if r["stage"] == "train"]
    rows = [
        {
            "step": r["step"],
            "layout": layout_key(r["layout"]) if "layout" in r else "",
            "ok": r["ok"],
            "peak_mib": r["peak_mib"],
            **(strategy.caps[i] if i < len(strategy.caps) else {}),
        }
        for i, r in enumerate(train)
    ]
    write_csv(args.out / "oom.csv", rows)
    events = [(e["stage"], e["layout"], e["error"][:60]) for e in cb.oom_events]
    print(f"oom events: {events}; recoveries logged: {[r['oom/recoveries'] for r in log.rows]}")
    if len(log.rows) != args.steps or not cb.oom_events or cb.oom_events[0]["stage"] != "train":
        raise SystemExit(
            f"expected {args.steps} steps with a recovered train-stage OOM; got {len(log.rows)} steps, "
            f"events {events}"
        )
    if cuda and "OutOfMemoryError" not in cb.oom_events[0]["error"]:
        raise SystemExit(f"the OOM was not torch.OutOfMemoryError: {cb.oom_events[0]['error']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["fit", "oom"])
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: fit 5, oom 2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--preset", default="qwen2.5-0.5b-shape", help="qwen2.5-0.5b-shape, or a preset / path"
    )
    args = p.parse_args(argv)
    args.steps = args.steps or (5 if args.part == "fit" else 2)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            "--device cuda: no CUDA GPU here; use --device cpu --preset earl-tiny for a dry run"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (fit if args.part == "fit" else oom)(args)


if __name__ == "__main__":
    main(sys.argv[1:])

"""One side of ``benchmarks/vs_trl_learning.py``, in a fresh process:
``python -m benchmarks.vs_trl_learning_side '<json LearnSpec>'`` (from the repository root).

GRPO from the same warm start on the same rows with the same settings, by earl_lightning or by
TRL 1.16's ``GRPOTrainer``; every ``eval_every`` steps (and before the first) both are evaluated
by the same function, :func:`held_out_accuracy`: the first ``eval_rows`` held-out rows played
greedily by earl_lightning's rollout loop on the model as it is, scored by TRL's
``accuracy_reward``. Evaluation time is left out of the training clock on both sides. Prints one
line ``VS_TRL_LEARNING {json}``: per evaluation, the step, the training seconds so far, the
accuracy; and the steps' rewards.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

RESULT_TAG = "VS_TRL_LEARNING "


@dataclass
class LearnSpec:
    side: str  # "earl" | "trl"
    seed: int
    model: str  # the warm start (a save_pretrained directory)
    train: str  # jsonl of TRL rows: prompt, completion (unused here), solution
    test: str
    steps: int = 100
    eval_every: int = 20
    eval_rows: int = 200
    lr: float = 1e-4
    batch: int = 64
    group: int = 8
    max_new_tokens: int = 64
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl: float = 0.0
    temperature: float = 1.0
    threads: int = 2


def load_rows(path: str):
    from datasets import load_dataset

    return load_dataset("json", data_files={"rows": path})["rows"].remove_columns(["completion"])


def held_out_accuracy(model, tokenizer, rows, max_new_tokens: int) -> float:
    """Greedy accuracy on ``rows`` (earl's rollout loop, HF backend, TRL's accuracy_reward)."""
    from trl.rewards import accuracy_reward

    from earl_lightning.models import eval_mode
    from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
    from earl_lightning.rollout.scoring import score_episodes
    from earl_lightning.tasks.rewards import resolve_reward_funcs

    specs = [
        EpisodeSpec(None, seed=i, group_id=i, episode_id=i, row=dict(r), row_index=i)
        for i, r in enumerate(rows)
    ]
    with eval_mode(model), torch.no_grad():
        episodes = rollout(
            specs,
            HFBackend(model, tokenizer),
            tokenizer,
            SamplingConfig(max_new_tokens=max_new_tokens, greedy=True, seed=0),
            max_turns=1,
            max_context_tokens=512,
        )
    score_episodes(episodes, resolve_reward_funcs([accuracy_reward], None), tokenizer)
    return sum(ep.rewards.get("accuracy_reward") or 0.0 for ep in episodes) / max(len(episodes), 1)


class Clock:
    """Training seconds: wall time since the first step began, less the evaluations'."""

    def __init__(self) -> None:
        self.start, self.eval_s, self.points, self.rewards = None, 0.0, [], []

    def train_s(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start - self.eval_s

    def evaluate(self, step: int, model, tokenizer, rows, spec: LearnSpec) -> None:
        t0 = time.perf_counter()
        acc = held_out_accuracy(model, tokenizer, rows, spec.max_new_tokens)
        self.points.append({"step": step, "train_s": self.train_s(), "accuracy": acc})
        self.eval_s += time.perf_counter() - t0


def run_earl(spec: LearnSpec) -> Clock:
    import lightning as L
    from trl.rewards import accuracy_reward

    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule

    clock, test = Clock(), load_rows(spec.test).select(range(spec.eval_rows))

    class Hooks(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if clock.start is None:
                clock.start = time.perf_counter()
                clock.evaluate(0, module.policy, module.tokenizer, test, spec)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            clock.rewards.append(float(trainer.callback_metrics["rewards/accuracy_reward/mean"]))
            if trainer.global_step % spec.eval_every == 0:
                clock.evaluate(trainer.global_step, module.policy, module.tokenizer, test, spec)

    module = AgenticRLModule(
        model=spec.model,
        seed=spec.seed,
        transcripts={"every_n_steps": 0},
        rollout={
            "max_turns": 1,
            "max_context_tokens": 512,
            "sampling": {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature},
        },
        algorithm={
            "advantage": {"name": "grpo", "scale": "group"},
            "kl": {"coef": spec.kl},
            "loss": {
                "name": "ppo_clip",
                "clip_low": spec.clip_low,
                "clip_high": spec.clip_high,
                "aggregation": "token_mean",
            },
        },
        optim={"lr": spec.lr, "lr_schedule": "constant", "max_grad_norm": 1.0},
    )
    data = EpisodeDataModule(
        dataset=load_rows(spec.train),
        reward_funcs=[accuracy_reward],
        batch_size=spec.batch,
        group_size=spec.group,
        seed=spec.seed,
        eval_episodes=0,
    )
    L.seed_everything(spec.seed, verbose=False)
    trainer = L.Trainer(
        max_steps=spec.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Hooks()],
    )
    trainer.fit(module, data)
    return clock


def run_trl(spec: LearnSpec) -> Clock:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import accuracy_reward

    clock, test = Clock(), load_rows(spec.test).select(range(spec.eval_rows))
    tok = AutoTokenizer.from_pretrained(spec.model)
    tok.padding_side = "left"

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
            if clock.start is None:
                clock.start = time.perf_counter()
                clock.evaluate(0, model, tok, test, spec)

        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            if state.global_step % spec.eval_every == 0:
                clock.evaluate(state.global_step, model, tok, test, spec)

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "rewards/accuracy_reward/mean" in logs:
                clock.rewards.append(float(logs["rewards/accuracy_reward/mean"]))

    out = tempfile.TemporaryDirectory(prefix="vs_trl_learning_")
    args = GRPOConfig(
        output_dir=out.name,
        use_cpu=True,
        report_to=[],
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec.group,
        max_completion_length=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=1.0,
        top_k=0,
        beta=spec.kl,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        loss_type="dapo",
        scale_rewards="group",
        epsilon=spec.clip_low,
        epsilon_high=spec.clip_high,
        logging_steps=1,
        save_strategy="no",
        seed=spec.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
    )  # TRL's defaults: bf16, checkpointing
    trainer = GRPOTrainer(
        model=spec.model,
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=load_rows(spec.train),
        processing_class=tok,
        callbacks=[Hooks()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    out.cleanup()
    return clock


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.vs_trl_learning_side '<json LearnSpec>'")
    spec = LearnSpec(**json.loads(argv[0]))
    if spec.side not in ("earl", "trl"):
        raise SystemExit(f"bad side {spec.side!r}; valid: earl, trl")
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    clock = (run_earl if spec.side == "earl" else run_trl)(spec)
    print(
        RESULT_TAG
        + json.dumps({"spec": asdict(spec), "points": clock.points, "rewards": clock.rewards}),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])

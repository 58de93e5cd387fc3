"""One side of ``benchmarks/vs_trl.py``, run in a fresh process:
``python -m benchmarks.vs_trl_sides '<json RunSpec>'`` (from the repository root).

It times a fixed matmul workload before and after (the machine-speed guard), and trains earl_lightning or
TRL's ``GRPOTrainer`` for ``steps`` RL steps on the task of :mod:`benchmarks.vs_trl_env`, and
prints one line ``VS_TRL_RESULT {json}`` with the wall and CPU clocks at every step end, the
rewards and generated tokens of every step, and the process's peak RSS.

Both sides: the earl-tiny weights in fp32, ``batch`` completions per step in groups of ``group``,
temperature 1, no KL, AdamW at a constant ``lr``, grad-norm clip 1.0, one optimizer step per batch
over one micro-batch, token-mean (DAPO) loss aggregation, PPO clip 0.2, group-std advantages.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.vs_trl_env import DigitTurns, digit_reward, prompts

RESULT_TAG = "VS_TRL_RESULT "
ENV_PATHS = {
    "single": "benchmarks.vs_trl_env.PromptTask",
    "multi": "benchmarks.vs_trl_env.DigitTurns",
}


@dataclass
class RunSpec:
    """One run of one side; ``turns`` is 1 in the single-turn mode."""

    side: str  # "earl" | "trl"
    mode: str  # "single" | "multi"
    completion_len: int
    turns: int
    steps: int
    warmup: int
    batch: int = 64
    group: int = 8
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2
    device: str = "cpu"
    # earl only: False recomputes the old log-probs (benchmarks/step_breakdown.py)
    on_policy_shortcut: bool = True
    # earl only: False runs every completion's prompt in the train forward
    share_prefix: bool = True
    share_prompts: bool = True  # earl only: False prefills every completion's prompt in the rollout
    # earl only: False runs the last layer at every position in the train forward
    scored_last_layer: bool = True
    causal_chunks: bool = True
    rms_norm_backward: bool = True
    fused_elementwise: bool = True
    micro_batch_tokens: int = 1 << 20  # earl only: the padded-token budget of one forward/backward

    def env_kwargs(self) -> dict:
        if self.mode == "single":
            return {"completion_len": self.completion_len}
        return {"completion_len": self.completion_len, "turns": self.turns}


def machine_speed(threads: int, repeats: int = 3) -> float:
    """Seconds for a fixed CPU matmul workload (best of ``repeats``): the same on a quiet machine
    every time, so a slow value flags a run whose neighbours took the cores."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(384, 384, generator=gen), torch.randn(384, 384, generator=gen)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(40):
            a = torch.tanh(a @ b)
        best = min(best, time.perf_counter() - t0)
    return best


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


# ---- earl_lightning --------------------------------------------------------------------------
def _earl_clock():
    import lightning as L

    class StepClock(L.Callback):
        """Wall clock at the start of training and at the end of every step, and the step's
        ``reward/mean`` and ``tokens/generated`` (from ``trainer.callback_metrics``)."""

        def __init__(self) -> None:
            self.start, self.ends, self.cpu, self.rewards, self.tokens, self.stages = (
                0.0,
                [],
                [],
                [],
                [],
                [],
            )

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            m = trainer.callback_metrics
            self.rewards.append(float(m["reward/mean"]))
            self.tokens.append(float(m["tokens/generated"]))
            self.stages.append(
                {
                    k: float(v)
                    for k, v in m.items()
                    if k.startswith("stage/") and k.endswith("seconds")
                }
            )

    return StepClock()


def run_earl(spec: RunSpec) -> dict:
    import lightning as L

    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule

    module = AgenticRLModule(
        model="earl-tiny",
        dtype="float32",
        seed=spec.seed,
        transcripts={"every_n_steps": 0},
        rollout={
            "backend": "hf",
            "share_prompts": spec.share_prompts,
            "max_turns": spec.turns,
            "max_context_tokens": 4096,
            "history_turns": None,
            "sampling": {
                "max_new_tokens": spec.completion_len,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "stop": [],
            },
        },
        algorithm={
            "advantage": {"name": "grpo", "scale": "group"},
            "loss": {
                "name": "ppo_clip",
                "clip_low": 0.2,
                "clip_high": 0.2,
                "aggregation": "token_mean",
            },
            "kl": {"coef": 0.0},
        },
        optim={
            "lr": spec.lr,
            "weight_decay": 0.0,
            "lr_schedule": "constant",
            "max_grad_norm": 1.0,
            "ppo_epochs": 1,
            "mini_batches": 1,
            "micro_batch_tokens": spec.micro_batch_tokens,
            "on_policy_shortcut": spec.on_policy_shortcut,
            "share_prefix": spec.share_prefix,
            "scored_last_layer": spec.scored_last_layer,
            "causal_chunks": spec.causal_chunks,
            "rms_norm_backward": spec.rms_norm_backward,
            "fused_elementwise": spec.fused_elementwise,
        },
    )
    data = EpisodeDataModule(
        env=ENV_PATHS[spec.mode],
        env_kwargs=spec.env_kwargs(),
        batch_size=spec.batch,
        group_size=spec.group,
        seed=spec.seed,
        eval_episodes=0,
    )
    clock = _earl_clock()
    trainer = L.Trainer(
        max_steps=spec.steps,
        accelerator="gpu" if spec.device == "cuda" else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(module, data)
    return {
        "start": clock.start,
        "ends": clock.ends,
        "cpu": clock.cpu,
        "rewards": clock.rewards,
        "tokens": clock.tokens,
        "stages": clock.stages,
    }


# ---- TRL ---------------------------------------------------------------------------------------
def _trl_clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall clock at the start of training and at the end of every optimizer step; the logged
        ``reward`` and ``completions/mean_length`` of every step (``logging_steps=1``); and the
        step's split (:func:`_time_trl_stages`) under earl's stage names: ``rollout`` is TRL's
        generation and scoring, ``train`` the rest of its ``training_step`` (loss forward and
        backward)."""

        def __init__(self) -> None:
            self.start, self.ends, self.cpu, self.logs, self.stages = 0.0, [], [], [], []
            self.generation_s = self.training_step_s = 0.0

        def on_train_begin(self, args, state, control, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.stages.append(
                {
                    "stage/rollout/seconds": self.generation_s,
                    "stage/train/seconds": self.training_step_s - self.generation_s,
                }
            )
            self.generation_s = self.training_step_s = 0.0

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    return StepClock()


def _time_trl_stages(trainer, clock) -> None:
    """Time the trainer's ``training_step`` and, within it, ``_generate_and_score_completions``
    (every step generates: ``steps_per_generation=1``, ``num_iterations=1``) into ``clock``; the
    instance's wrappers call TRL's own methods."""
    trainer._generate_and_score_completions = _timed(
        trainer._generate_and_score_completions, clock, "generation_s"
    )
    trainer.training_step = _timed(trainer.training_step, clock, "training_step_s")


def _timed(fn, clock, attr: str):
    """``fn``, adding the wall seconds of every call to ``clock.<attr>``."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(clock, attr, getattr(clock, attr) + time.perf_counter() - t0)

    return wrapper


def _trl_turn_text(tokenizer, observation: str, ended_eos: bool) -> list[int]:
    """The tokens between two assistant turns, exactly as the ChatML template renders them (the
    sampled eos already is the closing ``<|im_end|>``)."""
    text = (
        "\n" if ended_eos else "<|im_end|>\n"
    ) + f"<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def _generate_turn(trainer, contexts: list[list[int]]) -> list[list[int]]:
    """One assistant turn for every context: TRL's own transformers generation path
    (``_generate_single_turn`` without vLLM): left-padded batch, the trainer's generation config,
    cut after the first eos. Each turn re-encodes its whole context (``generate`` keeps no cache
    between calls)."""
    from trl.models import unwrap_model_for_generation

    tok, dev = trainer.processing_class, trainer.accelerator.device
    width = max(map(len, contexts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(c)) + c for c in contexts], device=dev)
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=dev)
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator, generation_kwargs=trainer.generation_kwargs
        ) as model,
        torch.no_grad(),
    ):
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=trainer.generation_config
        )
    eos = set(trainer.eos_token_ids)
    turns = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        turns.append(row[:cut])
    return turns


def make_rollout_func(spec: RunSpec, seeds: dict[str, int]):
    """TRL's multi-turn hook (``GRPOTrainer(rollout_func=...)``): play every prompt's episode of
    :class:`DigitTurns` for ``spec.turns`` turns; the completion is every turn's tokens with the
    environment's feedback between them (``env_mask`` 0), the reward the episode's sum."""

    def rollout_func(batch_prompts: list, trainer) -> dict:
        tok = trainer.processing_class
        prompt_ids = tok.apply_chat_template(
            conversation=batch_prompts, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        envs = [DigitTurns(spec.completion_len, spec.turns) for _ in batch_prompts]
        for env, p in zip(envs, batch_prompts):
            env.reset(seeds[p[-1]["content"]])
        completion = [[] for _ in envs]
        env_mask = [[] for _ in envs]
        rewards = [0.0] * len(envs)
        for _turn in range(spec.turns):
            replies = _generate_turn(trainer, [p + c for p, c in zip(prompt_ids, completion)])
            for i, (env, reply) in enumerate(zip(envs, replies)):
                completion[i] += reply
                env_mask[i] += [1] * len(reply)
                result = env.step(tok.decode(reply, skip_special_tokens=True))
                rewards[i] += result.reward
                if not result.done:
                    ended_eos = bool(reply) and reply[-1] in trainer.eos_token_ids
                    between = _trl_turn_text(tok, result.observation, ended_eos)
                    completion[i] += between
                    env_mask[i] += [0] * len(between)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion,
            "logprobs": None,
            "env_mask": env_mask,
            "env_reward": rewards,
        }

    return rollout_func


def _trl_dataset(spec: RunSpec):
    """The prompts in conversational form (TRL applies the same chat template), and for the
    multi-turn mode each first observation's episode seed."""
    from datasets import Dataset

    if spec.mode == "single":
        texts = prompts()
    else:
        texts = [
            DigitTurns(spec.completion_len, spec.turns).reset(s) for s in range(len(prompts()))
        ]
    seeds = {t: s for s, t in enumerate(texts)}
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts]}), seeds


def run_trl(spec: RunSpec) -> dict:
    # rollout_func is "experimental" in TRL 1.16
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from earl_lightning.models import resolve_model_path

    path = resolve_model_path("earl-tiny")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    dataset, seeds = _trl_dataset(spec)
    multi = spec.mode == "multi"

    def reward(completions, **kwargs):
        if multi:
            return list(kwargs["env_reward"])
        return [digit_reward(c[0]["content"], spec.completion_len) for c in completions]

    out_dir = tempfile.TemporaryDirectory(prefix="vs_trl_")  # save_strategy "no": it stays empty
    args = GRPOConfig(
        output_dir=out_dir.name,
        use_cpu=spec.device == "cpu",
        report_to=[],
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec.group,
        max_completion_length=spec.completion_len,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        seed=spec.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    clock = _trl_clock()
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[clock],
        rollout_func=make_rollout_func(spec, seeds) if multi else None,
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict
    _time_trl_stages(trainer, clock)
    trainer.train()
    out_dir.cleanup()
    logs = clock.logs[: len(clock.ends)]
    return {
        "start": clock.start,
        "ends": clock.ends,
        "cpu": clock.cpu,
        "rewards": [float(x["reward"]) for x in logs],
        "tokens": [float(x["completions/mean_length"]) * spec.batch for x in logs],
        "stages": clock.stages,
    }


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.vs_trl_sides '<json RunSpec>'")
    spec = RunSpec(**json.loads(argv[0]))
    if spec.side not in ("earl", "trl") or spec.mode not in ENV_PATHS:
        raise SystemExit(
            f"bad side/mode {spec.side!r}/{spec.mode!r}; valid: earl|trl, {sorted(ENV_PATHS)}"
        )
    torch.set_num_threads(spec.threads)
    guard = machine_speed(spec.threads)
    torch.manual_seed(spec.seed)
    out = (run_earl if spec.side == "earl" else run_trl)(spec)
    # neighbours that arrived during the run count too
    guard = max(guard, machine_speed(spec.threads))
    gpu = torch.cuda.max_memory_allocated() / 2**20 if spec.device == "cuda" else 0.0
    out.update(spec=asdict(spec), guard_s=guard, peak_rss_mib=peak_rss_mib(), peak_gpu_mib=gpu)
    print(RESULT_TAG + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

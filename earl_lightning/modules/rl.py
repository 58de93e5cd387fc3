"""The RL iteration as a LightningModule over a HF causal LM (GRPO, RLOO, REINFORCE++, PPO, ...).

One training step = one RL iteration (manual optimization), read top to bottom in
:meth:`AgenticRLModule.training_step`: rollout -> experience (old/ref log-probs, values,
advantages) -> train (``ppo_epochs`` passes over mini-batches of token-budgeted micro-batches).
Each stage runs under the layout its strategy picks (:mod:`earl_lightning.stages`);
the DataModule's exchanger decides where episodes and rows live; the algorithm comes from the
registries named in the typed configuration (:mod:`earl_lightning.modules.config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from typing_extensions import override

from earl_lightning.algorithms import get_kl_estimator
from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.checkpoints.export import gather_state_dict, write_pretrained
from earl_lightning.core.config_groups import coerce, to_dict
from earl_lightning.core.host_memory import apply_host_memory, host_memory_mode
from earl_lightning.core.seeding import run_seed
from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.models.lora import LoraSettings, apply_lora, check_targets
from earl_lightning.modules.algorithm_groups import check_draws
from earl_lightning.modules.config import (
    A,
    AlgorithmConfig,
    OptimConfig,
    RolloutConfig,
    check_combination,
    check_module_args,
)
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.evaluation import EvaluationHooks
from earl_lightning.modules.metrics import RunMetrics, batch_stats
from earl_lightning.modules.play import RolloutPlay
from earl_lightning.modules.rollout_setup import check_first_observation
from earl_lightning.modules.sampled_eval import SampledEvalMetrics
from earl_lightning.modules.signal import LearningSignal
from earl_lightning.modules.step_logging import StepLogging
from earl_lightning.modules.transcripts import EpisodeLog, TranscriptConfig, transcript_settings
from earl_lightning.modules.views import (
    exactly_on_policy,
    module_hparams,
    update_view,
    workload_view,
)
from earl_lightning.parallel.memory import Workload
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.endpoint import EndpointServer
from earl_lightning.stages import (
    StageContext,
    StageOOMHandler,
    StageRunner,
    StageTimer,
    check_env_failures,
    free_memory,
    stages_of,
)
from earl_lightning.strategies.faults import trainer_lost_peer
from earl_lightning.train.advantages import check_whole_groups, estimate_advantages
from earl_lightning.train.forward import fill_experience
from earl_lightning.train.scored import can_score_last_layer
from earl_lightning.train.update import Models, UpdateConfig, ppo_update


class AgenticRLModule(StepLogging, EvaluationHooks, RolloutPlay, L.LightningModule):
    """Multi-turn agentic RL of a causal LM.

    Args:
        model: hub id, local path, or an offline preset (``earl-tiny``).
        dtype: parameter dtype of the policy.
        rollout: how episodes are played (backend, turns, context, history window, sampling).
        algorithm: advantage estimator and policy loss by registry name, KL, entropy, value head.
        optim: AdamW, its schedule, epochs, mini-batches and the micro-batch token budget.
        seed: base seed of the sampling RNG (per step and data-parallel rank) and the value head;
            null (default): the run's seed (``seed_everything``).
        transcripts: which episode transcripts are logged to TensorBoard, how many and how often;
            the first prompt as the model reads it; every episode as JSON lines (``dump``).
        transcript_every_n_steps: deprecated: ``transcripts.every_n_steps``.
        no_signal_steps: warn once when this many steps in a row had no learning signal (every
            group's rewards equal, or a gradient norm of 0; ``train/steps_without_signal`` counts
            them, and the progress bar shows them); 0: never.
        logprob_mismatch_warn: warn when rollout and recomputed log-probs differ by more than this.
        peft: train LoRA adapters (``peft``) instead of all weights: rank, alpha, dropout, target
            modules. The KL reference is then the same model with its adapters off (no second copy),
            and engines and exports get the merged weights. null: full fine-tuning.

    Raises:
        ValueError: a setting out of range or settings that do not work together (named as the
            ``earl`` command's ``--model.*`` argument), or a tokenizer without a chat template.
        FileNotFoundError: a ``model`` path that does not exist or lacks a model's files, or a
            tokenizer that does not load from it.
    """

    def __init__(
        self,
        model: str = "earl-tiny",
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        rollout: RolloutConfig = RolloutConfig(),
        algorithm: AlgorithmConfig = AlgorithmConfig(),
        optim: OptimConfig = OptimConfig(),
        seed: int | None = None,
        transcripts: TranscriptConfig = TranscriptConfig(),
        transcript_every_n_steps: int | None = None,
        logprob_mismatch_warn: float = 1e-3,
        peft: LoraSettings | None = None,
        no_signal_steps: int = 10,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.rollout_config = coerce(RolloutConfig, rollout, "--model.rollout")
        self.algorithm_config = coerce(AlgorithmConfig, algorithm, "--model.algorithm")
        self.optim_config = coerce(OptimConfig, optim, "--model.optim")
        check_combination(self.rollout_config, self.algorithm_config)
        seed = run_seed(seed, f"{A}.seed")
        self.transcripts = transcript_settings(transcripts, transcript_every_n_steps)
        check_module_args(dtype, seed, no_signal_steps, logprob_mismatch_warn)
        self.peft_config = None if peft is None else coerce(LoraSettings, peft, "--model.peft")
        host_memory_mode()  # a bad EARL_HOST_MEMORY fails here, while the run is being built
        self.save_hyperparameters(
            {
                **module_hparams(
                    model,
                    dtype,
                    self.rollout_config,
                    self.algorithm_config,
                    self.optim_config,
                    seed,
                    self.transcripts,
                    logprob_mismatch_warn,
                    no_signal_steps,
                ),
                "peft": None if peft is None else to_dict(self.peft_config),
            }
        )
        self.tokenizer = load_tokenizer(model, "--model.model")
        if self.peft_config is not None:
            check_targets(self.peft_config, model)
        self.allowed_token_ids = self.rollout_config.sampling.token_ids(self.tokenizer)
        self.policy = self.ref_policy = self.value_head = None
        # RL iterations done (checkpointed: sampling seeds continue from here)
        self.rl_iteration = 0
        self.oom_recoveries = 0
        self.run_metrics = RunMetrics()
        self.sampled_eval = SampledEvalMetrics(0, 1.0)  # --data.eval_samples, set at setup
        self._backend = None
        self._endpoint: EndpointServer | None = None  # started at the first agent rollout
        self._reward_outcomes: list = []  # the last scoring's outcomes on this rank (log_metric values)
        self.signal = LearningSignal(no_signal_steps)
        self.episode_log = EpisodeLog(self.transcripts, seed)

    # ---- what the run is made of -------------------------------------------------------------
    @property
    def sampling(self) -> SamplingConfig:
        """The rollout's sampling settings as the backends take them, restricted to the allowed
        tokens when ``rollout.sampling`` names some."""
        return self.rollout_config.sampling.request(self.allowed_token_ids)

    @property
    def _on_policy(self) -> bool:
        return exactly_on_policy(self.rollout_config, self.algorithm_config, self.optim_config)

    @property
    def workload(self) -> Workload:
        """What the layout selector's memory model sizes (:func:`workload_view`)."""
        scored = self.policy is not None and can_score_last_layer(self.policy, now=False)
        return workload_view(
            self.rollout_config,
            self.algorithm_config,
            self.optim_config,
            lora=self.peft_config is not None,
            scored_last_layer=scored,
        )

    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp, algo = self.hparams, self.algorithm_config
        self.policy = load_model(hp.model, hp.dtype, "--model.model")
        if self.peft_config is not None:  # the base weights freeze; only the adapters train
            apply_lora(self.policy, self.peft_config)
        self.policy.config.use_cache = False
        self.policy.train()
        if algo.kl.coef and self.peft_config is None:
            # frozen; every forward of it runs in eval mode (fill_logprobs' eval_mode), so between
            # them it rests in train mode like the policy: no module of the run is in eval mode
            # when training starts (Lightning warns of any that is)
            self.ref_policy = load_model(hp.model, hp.dtype, "--model.model").requires_grad_(False)
            self.ref_policy.train()
        if algo.needs_values:
            torch.manual_seed(hp.seed)
            self.value_head = torch.nn.Linear(self.policy.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        cfg = self.optim_config
        opt = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.999),
            eps=1e-8,
        )
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 1000
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: cfg.lr_factor(step, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @override
    def setup(self, stage: str) -> None:
        apply_host_memory()  # freed activations are kept for the next step (earl_lightning/core/host_memory.py)
        dm = self.trainer.datamodule
        if isinstance(dm, EpisodeDataModule) and not self.run_metrics.reward_names:
            self.run_metrics.track_rewards([f.name for f in dm.reward_funcs])
        if isinstance(dm, EpisodeDataModule):
            self.check_data(dm, self.trainer.world_size)
            if self.sampled_eval.samples != dm.eval_samples:
                self.sampled_eval = SampledEvalMetrics(dm.eval_samples, dm.eval_pass_reward)

    def check_data(self, dm: EpisodeDataModule, world_size: int) -> None:
        """Settings of the model and the data that are valid alone but not together: a first prompt
        too long, tools without a parser, an estimator that needs whole groups per rank (the
        ``earl`` command checks them before anything runs).

        Args:
            dm: the data the module will train on.
            world_size: the processes the run uses (``Trainer.world_size``).

        Raises:
            ValueError: the first prompt (with ``max_new_tokens``) exceeds
                ``--model.rollout.max_context_tokens``, tools without ``--model.rollout.tool_parser``,
                an environment whose first reset fails, an estimator that needs whole groups per
                rank with groups split across ranks, or dynamic sampling with groups of one.
        """
        check_first_observation(self.rollout_config, self.tokenizer, dm.first_spec(), dm.tools)
        check_whole_groups(
            self.algorithm_config.advantage.name,
            self.algorithm_config.advantage.estimator,
            world_size,
            dm.exchanger.config.keep_groups,
        )
        check_draws(self.algorithm_config.dynamic_sampling, dm.group_size)

    # ---- the RL iteration ----------------------------------------------------------------------
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """One RL iteration: rollout, experience, train, each under the layout its strategy
        picks (:mod:`earl_lightning.stages`; a stage that ran out of memory is tried again), the
        batch moving between layouts by the exchanger."""
        step, specs = batch["step"], batch["specs"]
        runner, exchanger = self._runner(StageTimer()), self._exchanger()
        num_groups = max(s.group_id for s in specs) + 1
        for attempt in runner.attempts("rollout", self._spec_stats(specs)):
            with attempt as rollout_ctx:
                draws = self._draw(step, specs, num_groups, rollout_ctx)
        with runner.outside("the env-failure check"):
            check_env_failures(
                draws.played, rollout_ctx.reduce, self.rollout_config.max_failed_share, step
            )
        played = episodes_to_experience(
            draws.batch(), gamma=self.algorithm_config.advantage.effective("gamma", 1.0)
        )

        with runner.outside("the batch statistics"):
            stats = batch_stats(played, rollout_ctx.reduce)
        for attempt in runner.attempts("experience", stats):
            with attempt as exp_ctx:
                here = exchanger.exchange(played, src=rollout_ctx.layout, to=exp_ctx.layout)
                scored = self._advantages(self._fill(here, exp_ctx), num_groups, exp_ctx)

        with runner.outside("the batch statistics"):
            stats = batch_stats(scored, exp_ctx.reduce)
        for attempt in runner.attempts("train", stats):
            with attempt as train_ctx:
                exp = exchanger.exchange(scored, src=exp_ctx.layout, to=train_ctx.layout)
                update = ppo_update(
                    Models(self.policy, self.value_head),
                    self.optimizers(),
                    self.lr_schedulers(),
                    exp,
                    self._update_config(train_ctx),
                    train_ctx.reduce,
                    self.manual_backward,
                )
                self._backend.after_update(train_ctx.model("policy"))

        self.rl_iteration, self.oom_recoveries = step + 1, self.oom_recoveries + runner.recoveries
        with runner.outside("the step's metric reductions"):
            metrics = self._step_metrics(
                runner, draws, num_groups, exp, update, rollout_ctx, train_ctx
            )
        for ctx in (exp_ctx, train_ctx):  # the micro-batch budget each forward stage ran with
            budget = ctx.budget(self.optim_config.micro_batch_tokens)
            metrics[f"stage/{ctx.name}/micro_batch_tokens"] = float(budget)
        self._log_step(metrics, draws.first, step, rollout_ctx.reduce.counts_here)

    def _fill(self, exp: ExperienceBatch, ctx: StageContext) -> ExperienceBatch:
        """Old log-probs (and values), and reference log-probs when there is a KL term."""
        kw = dict(
            temperature=self.rollout_config.sampling.temperature,
            allowed=self.allowed_token_ids,
            micro_batch_tokens=ctx.budget(self.optim_config.micro_batch_tokens),
            share_prefix=self.optim_config.share_prefix,
            scored=self.optim_config.scored_last_layer,
            chunked=self.optim_config.causal_chunks,
        )
        kl = self.algorithm_config.kl.coef > 0
        return fill_experience(
            exp,
            ctx.model("policy"),
            self.value_head,
            # on-policy: the training forward's own log-probs serve as the old ones
            old=not self._on_policy,
            reference=ctx.model("ref_policy") if self.ref_policy is not None else None,
            # LoRA: the reference is the policy with its adapters off
            adapters_off=kl and self.ref_policy is None,
            **kw,
        )

    def _advantages(
        self, exp: ExperienceBatch, num_groups: int, ctx: StageContext
    ) -> ExperienceBatch:
        algo = self.algorithm_config
        penalty = None
        if algo.kl.coef and algo.kl.in_reward:
            kl = get_kl_estimator(algo.kl.estimator)(
                exp.tokens["old_logprobs"], exp.tokens["ref_logprobs"]
            )
            penalty = algo.kl.coef * exp.pad(kl, 0.0)
        return estimate_advantages(
            exp,
            algo.advantage.estimator,
            algo.advantage.params,
            num_groups=num_groups,
            reduce=ctx.reduce.sum_moments,
            kl_penalty=penalty,
        )

    def _update_config(self, ctx: StageContext) -> UpdateConfig:
        return update_view(
            self.rollout_config,
            self.algorithm_config,
            self.optim_config,
            micro_batch_tokens=ctx.budget(self.optim_config.micro_batch_tokens),
            allowed_token_ids=self.allowed_token_ids,
        )

    # ---- helpers of the step -------------------------------------------------------------------
    def _stages(self):
        return stages_of(self.trainer.strategy, self, self.trainer.world_size)

    def _runner(self, timer: StageTimer) -> StageRunner:
        t = self.trainer
        handlers = [cb for cb in t.callbacks if isinstance(cb, StageOOMHandler)]
        return StageRunner(
            self._stages(),
            handlers,
            lambda h, *a: h.on_stage_oom(t, self, *a),
            lambda: free_memory(t.optimizers, self._backend),
            timer,
            trainer_lost_peer(t, f"RL step {t.global_step}"),
        )

    def _spec_stats(self, specs: list) -> dict[str, float]:
        return {"num_seqs": len(specs), "gen_len": self.rollout_config.sampling.max_new_tokens}

    def save_pretrained(self, directory: str | Path) -> Path:
        """The policy and its tokenizer (with the chat template) as a ``save_pretrained``
        directory that transformers, vLLM and ``--model.model`` load: TRL's
        ``trainer.save_model``. Sharded weights are gathered (under several processes every
        process calls it), LoRA adapters merged; process 0 writes, atomically.

        Args:
            directory: where to write; replaced whole when it exists.

        Returns:
            ``directory`` as a Path (on every process; only process 0 wrote it).
        """
        state = gather_state_dict(self.policy, keep=self.global_rank == 0)
        if self.global_rank == 0:
            write_pretrained(self.policy, self.tokenizer, directory, state)
        return Path(directory)

    @override
    def teardown(self, stage: str) -> None:
        if self._endpoint is not None:  # the agents' endpoint serves one fit (or validate)
            self._endpoint.close()
            self._endpoint = None

    # ---- checkpointing -------------------------------------------------------------------------
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["earl"] = {"rl_iteration": self.rl_iteration}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.rl_iteration = checkpoint.get("earl", {}).get("rl_iteration", 0)
        self.configure_model()

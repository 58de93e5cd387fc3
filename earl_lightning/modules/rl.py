"""The RL iteration as a LightningModule: GRPO, REINFORCE++ and PPO over a HF causal LM.

One training step = one RL iteration (manual optimization):
rollout -> old/ref log-probs (+ values) -> advantages -> ``ppo_epochs`` passes over mini-batches,
each cut into micro-batches by a token budget, with gradient accumulation, clipping and an LR
schedule. Each stage runs inside ``strategy.stage(...)`` when the strategy has one (EarlStrategy),
so it may run under its own parallel layout.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist

from earl_lightning.algorithms import get_kl_estimator, get_loss_aggregation
from earl_lightning.data.experience import ExperienceBatch
from earl_lightning.parallel.layout import Layout
from earl_lightning.models import load_model, load_tokenizer, resolve_dtype
from earl_lightning.modules import metrics as M
from earl_lightning.modules.experience_ops import compute_advantages, episodes_to_experience, fill_logprobs
from earl_lightning.modules.update import UpdateConfig, ppo_update
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.loop import rollout
from earl_lightning.rollout.types import EpisodeSpec

Algorithm = Literal["grpo", "reinforce_pp", "ppo"]
_ESTIMATOR = {"grpo": "grpo", "reinforce_pp": "reinforce_pp", "ppo": "gae"}


def allowed_token_ids(tokenizer, tokens: list[str] | None, arg: str) -> list[int] | None:
    """The token ids of ``tokens`` (each string must be exactly one token of ``tokenizer``)."""
    if tokens is None:
        return None
    if isinstance(tokens, str) or not isinstance(tokens, (list, tuple)) or not tokens or \
            not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"`{arg}` must be a non-empty list of non-empty strings such as ['0', '1', '2'], "
                         f"got {tokens!r}")
    ids = []
    for t in tokens:
        enc = tokenizer.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"`{arg}` entry {t!r} is {len(enc)} tokens {enc} for this tokenizer; each entry must "
                             f"be exactly one token")
        ids.append(int(enc[0]))
    dup = sorted({t for t, i in zip(tokens, ids) if ids.count(i) > 1})
    if dup:
        raise ValueError(f"`{arg}` entries {dup} map to the same token; list each token once")
    return ids


class AgenticRLModule(L.LightningModule):
    """Multi-turn agentic RL of a causal LM.

    Args:
        model: hub id, local path, or an offline preset (``earl-tiny``).
        dtype: parameter dtype of the policy.
        algorithm: ``grpo`` (group-normalized outcome advantages), ``reinforce_pp`` (REINFORCE++:
            batch-whitened returns, the EARL paper's estimator) or ``ppo`` (GAE with a value head).
        backend: generation backend, ``hf`` (transformers, KV cache reused across turns) or ``vllm``.
        reuse_kv: ``hf`` backend only; False re-encodes the whole context every turn (reference path).
        max_turns: turns per episode before it is truncated.
        max_context_tokens: an episode ends (truncated) when its next turn would exceed this.
        max_new_tokens, temperature, top_p, top_k, stop: sampling per turn.
        allowed_tokens: restrict every generated token to these strings, each exactly one token of
            the tokenizer (e.g. the digits of a board game's columns). The policy is then the
            softmax over those tokens' logits, in the rollout (hf and vLLM) and in the trainer's
            log-probs, entropy and KL alike. None (default) allows the whole vocabulary.
        system_prompt: optional system message before the first observation.
        history_turns: None (default): every turn is generated from the whole chat so far and the
            episode is trained as one sequence. ``k >= 0``: each turn sees [system] + the last
            ``k`` exchanges + the current observation (0: the observation alone), and the trainer
            learns from one row per turn whose last token carries the turn's reward plus the
            discounted return of the turns after it. Needs ``lam`` 1.0 with ``ppo`` and no
            ``kl_in_reward`` (both would need values or penalties of later turn rows).
        lr, weight_decay, warmup_steps, lr_schedule: AdamW and its schedule (per optimizer step).
        max_grad_norm: gradient clipping (0 disables).
        ppo_epochs: passes over each RL batch; mini_batches: optimizer steps per pass.
        micro_batch_tokens: padded-token budget of one forward/backward (gradient accumulation).
        clip_low, clip_high: PPO ratio clipped to ``[1 - clip_low, 1 + clip_high]``.
        loss_agg: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO), ``seq_mean_token_sum_norm`` (Dr. GRPO).
        loss_norm_constant: the constant of ``seq_mean_token_sum_norm`` (default: max_context_tokens).
        grpo_scale: GRPO advantage scale: ``group`` std, ``batch`` std or ``none``.
        kl_coef, kl_estimator, kl_in_reward: KL to a frozen reference model (0 disables; ``k1``/``k2``/``k3``;
            as a loss term, or subtracted from the token rewards).
        entropy_coef: entropy bonus.
        gamma, lam: discount and GAE lambda.
        value_coef, value_clip: PPO value loss weight and clipping.
        transcript_every_n_steps: log an episode transcript to TensorBoard every N steps (0 disables).
        logprob_mismatch_warn: warn when rollout and recomputed log-probs differ by more than this.
        seed: base seed of the sampling RNG (per step and data-parallel rank).
    """

    def __init__(
        self,
        model: str = "earl-tiny",
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        algorithm: Algorithm = "grpo",
        backend: Literal["hf", "vllm"] = "hf",
        reuse_kv: bool = True,
        max_turns: int = 32,
        max_context_tokens: int = 4096,
        max_new_tokens: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        allowed_tokens: list[str] | None = None,
        system_prompt: str | None = None,
        history_turns: int | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine", "linear"] = "constant",
        max_grad_norm: float = 1.0,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        micro_batch_tokens: int = 16384,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        loss_agg: str = "token_mean",
        loss_norm_constant: float | None = None,
        grpo_scale: Literal["group", "batch", "none"] = "group",
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_in_reward: bool = False,
        entropy_coef: float = 0.0,
        gamma: float = 1.0,
        lam: float = 1.0,
        value_coef: float = 0.5,
        value_clip: float = 0.2,
        transcript_every_n_steps: int = 10,
        logprob_mismatch_warn: float = 1e-3,
        seed: int = 0,
    ):
        super().__init__()
        self.automatic_optimization = False
        self._validate(algorithm, backend, loss_agg, kl_estimator, grpo_scale, max_turns, max_context_tokens,
                       ppo_epochs, mini_batches, micro_batch_tokens, lr_schedule, dtype)
        self._validate_history(history_turns, algorithm, lam, kl_coef, kl_in_reward)
        self.save_hyperparameters()
        self.tokenizer = load_tokenizer(model, "--model.model")
        self.allowed_token_ids = allowed_token_ids(self.tokenizer, allowed_tokens, "--model.allowed_tokens")
        self.sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k, stop=list(stop or []), allowed_token_ids=self.allowed_token_ids)
        self.policy = None
        self.ref_policy = None
        self.value_head = None
        self.rl_iteration = 0  # RL iterations done (checkpointed; the data stream resumes here)
        self._backend = self._dispatcher = None
        self._backend_model_id: int | None = None  # an id, not the model: no second copy in the state dict
        self._dispatch_stats: dict[str, float] = {}
        self.oom_recoveries = 0
        self.max_oom_retries = 3

    # ---- configuration -------------------------------------------------------------------
    @staticmethod
    def _validate(algorithm, backend, loss_agg, kl_estimator, grpo_scale, max_turns, max_context_tokens,
                  ppo_epochs, mini_batches, micro_batch_tokens, lr_schedule, dtype) -> None:
        choices = {"algorithm": (algorithm, list(_ESTIMATOR)), "backend": (backend, ["hf", "vllm"]),
                   "grpo_scale": (grpo_scale, ["group", "batch", "none"]),
                   "lr_schedule": (lr_schedule, ["constant", "cosine", "linear"])}
        for arg, (value, valid) in choices.items():
            if value not in valid:
                raise ValueError(f"unknown `--model.{arg}` {value!r}; valid: {valid}")
        if backend == "vllm":
            from earl_lightning.rollout.backends.vllm import vllm_available, vllm_install_hint

            if not vllm_available():
                raise ImportError(f"`--model.backend vllm` needs vLLM, which is not installed; install it with: "
                                  f"{vllm_install_hint()}")
        get_loss_aggregation(loss_agg, "--model.loss_agg")
        get_kl_estimator(kl_estimator, "--model.kl_estimator")
        resolve_dtype(dtype, "--model.dtype")
        for arg, value in (("max_turns", max_turns), ("max_context_tokens", max_context_tokens),
                           ("ppo_epochs", ppo_epochs), ("mini_batches", mini_batches),
                           ("micro_batch_tokens", micro_batch_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`--model.{arg}` must be a positive integer, got {value!r}")

    @staticmethod
    def _validate_history(history_turns, algorithm, lam, kl_coef, kl_in_reward) -> None:
        from earl_lightning.rollout.loop import check_history_turns

        check_history_turns(history_turns, "--model.history_turns")
        if history_turns is None:
            return
        if algorithm == "ppo" and lam != 1.0:
            raise ValueError(f"`--model.lam` must be 1.0 with `--model.history_turns` ({history_turns}), got {lam!r}: "
                             f"each turn is its own row, and GAE with lam < 1 would need the value of the next "
                             f"turn's row; leave `history_turns` unset (null) for lam < 1")
        if kl_coef and kl_in_reward:
            raise ValueError(f"`--model.kl_in_reward` true is not supported with `--model.history_turns` "
                             f"({history_turns}): a later turn row's KL penalty would not reach the earlier rows' "
                             f"returns; use the KL as a loss term (kl_in_reward false)")

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        self.policy = load_model(hp.model, hp.dtype, "--model.model")
        self.policy.config.use_cache = False
        self.policy.train()
        if hp.kl_coef:
            self.ref_policy = load_model(hp.model, hp.dtype, "--model.model").eval().requires_grad_(False)
        if hp.algorithm == "ppo":
            torch.manual_seed(hp.seed)
            self.value_head = torch.nn.Linear(self.policy.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.999), eps=1e-8)
        total = max(1, (self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else 1000))

        def factor(step: int) -> float:
            if hp.warmup_steps and step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            frac = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
            if hp.lr_schedule == "cosine":
                return 0.5 * (1 + math.cos(math.pi * frac))
            if hp.lr_schedule == "linear":
                return 1.0 - frac
            return 1.0

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "first_spec"):
            self._check_first_observation(dm.first_spec())

    def _check_first_observation(self, spec: EpisodeSpec) -> None:
        """`max_context_tokens` smaller than the first observation fails before any work is done."""
        from earl_lightning.envs.base import make_env

        obs = make_env(spec.env, **spec.env_kwargs).reset(spec.seed)
        msgs = ([{"role": "system", "content": self.hparams.system_prompt}] if self.hparams.system_prompt else [])
        ids = self.tokenizer.apply_chat_template(msgs + [{"role": "user", "content": obs}],
                                                 add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        need = len(ids) + self.hparams.max_new_tokens
        if need > self.hparams.max_context_tokens:
            raise ValueError(
                f"`--model.max_context_tokens` ({self.hparams.max_context_tokens}) is smaller than the first "
                f"observation of env {spec.env!r} plus one turn: {len(ids)} prompt tokens + "
                f"{self.hparams.max_new_tokens} new tokens = {need}; raise it to at least {need}"
            )

    # ---- distributed helpers --------------------------------------------------------------
    @contextlib.contextmanager
    def _stage(self, name: str, stats: dict):
        """Run a stage under its layout: EarlStrategy picks (and switches to) it; any other
        strategy is plain data parallelism over the world."""
        stage = getattr(self.trainer.strategy, "stage", None)
        if callable(stage):
            with stage(name, stats) as layout:
                yield layout
        else:
            yield Layout(dp=self.trainer.world_size, tp=1)

    def _stage_model(self, attr: str = "policy"):
        """The model placed for the current stage's layout (the train copy outside EarlStrategy)."""
        get = getattr(self.trainer.strategy, "stage_model", None)
        return get(attr) if callable(get) else getattr(self, attr)

    def _local_specs(self, specs: list[EpisodeSpec], layout: Layout) -> list[EpisodeSpec]:
        """This data-parallel rank's share, whole groups at a time (TP peers get the same share)."""
        dp_rank = layout.coords(self.global_rank)[0]
        return [s for s in specs if s.group_id % layout.dp == dp_rank]

    def _all_reduce(self, t: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
        """Sum over ranks; under a TP layout only TP rank 0 of each group counts (peers hold copies)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return t
        t = t.clone()
        if layout is not None and layout.coords(self.global_rank)[1] != 0:
            t.zero_()
        dist.all_reduce(t)
        return t

    # ---- rollout --------------------------------------------------------------------------
    def backend(self, model):
        """The generation backend bound to ``model`` (a stage may hand out another placement)."""
        if self._backend is None or self._backend_model_id != id(model):
            if self.hparams.backend == "hf":
                from earl_lightning.rollout.backends.hf import HFBackend

                self._backend = HFBackend(model, self.tokenizer, reuse_kv=self.hparams.reuse_kv)
            else:
                from earl_lightning.rollout.backends.vllm import VLLMBackend

                # One engine for the run: prepare() moves it to each rollout layout's TP degree,
                # and a rebuilt engine takes its weights from the placement it was last handed.
                if isinstance(self._backend, VLLMBackend):
                    self._backend.weights_source = model
                else:
                    self._backend = VLLMBackend.for_module(self, model)
            self._backend_model_id = id(model)
        return self._backend

    def _rollout(self, specs: list[EpisodeSpec], sampling: SamplingConfig, layout: Layout):
        hp = self.hparams
        backend = self.backend(self._stage_model("policy"))
        if callable(getattr(backend, "prepare", None)):  # vLLM: engine for layout.tp, awake, synced
            backend.prepare(layout)
        try:
            return rollout(specs, backend, self.tokenizer, sampling, max_turns=hp.max_turns,
                           max_context_tokens=hp.max_context_tokens, system_prompt=hp.system_prompt,
                           history_turns=hp.history_turns)
        finally:
            backend.release(None)

    def _sampling_seed(self, step: int, layout: Layout) -> int:
        dp_rank = layout.coords(self.global_rank)[0]
        return (self.hparams.seed * 1_000_003 + step * 131 + dp_rank) % (2**31 - 1)

    # ---- the RL iteration -------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int):
        hp, step, specs = self.hparams, batch["step"], batch["specs"]
        num_groups = max(s.group_id for s in specs) + 1
        timer = M.StageTimer()

        def rollout_stage(layout):
            sampling = SamplingConfig(**{**vars(self.sampling), "seed": self._sampling_seed(step, layout)})
            return self._rollout(self._local_specs(specs, layout), sampling, layout), layout

        episodes, rollout_layout = self._run_stage("rollout", M.spec_stats(specs, hp.max_new_tokens),
                                                   rollout_stage, timer)
        counts = self._all_reduce(M.episode_counts(episodes), rollout_layout)
        exp = episodes_to_experience(episodes, gamma=hp.gamma)

        def experience_stage(layout):
            mbt = self._micro_batch_tokens(layout)
            out = self._exchange(exp, src=rollout_layout, to=layout)
            out = fill_logprobs(self._stage_model("policy"), out, name="old_logprobs", temperature=hp.temperature,
                                micro_batch_tokens=mbt, value_head=self.value_head, allowed=self.allowed_token_ids)
            if self.ref_policy is not None:
                out = fill_logprobs(self._stage_model("ref_policy"), out, name="ref_logprobs",
                                    temperature=hp.temperature, micro_batch_tokens=mbt, allowed=self.allowed_token_ids)
            return self._advantages(out, num_groups, layout), layout

        exp, layout = self._run_stage("experience", self._batch_stats(exp, rollout_layout), experience_stage, timer)

        def train_stage(train_layout):
            out = self._exchange(exp, src=layout, to=train_layout)
            cfg = self._update_config(self._micro_batch_tokens(train_layout))
            update = ppo_update(self, out, cfg, layout=train_layout)
            if callable(getattr(self._backend, "after_update", None)):  # vLLM: push weights, sleep
                self._backend.after_update(self._stage_model("policy"))
            return out, update, train_layout

        exp, update, train_layout = self._run_stage("train", self._batch_stats(exp, layout), train_stage, timer)
        self.rl_iteration = step + 1
        self._log_iteration(episodes[:2], counts, exp, update, timer, step, train_layout)

    def _batch_stats(self, exp: ExperienceBatch, layout: Layout) -> dict:
        """Context statistics of the GLOBAL batch (the selector sizes a layout for all of it, and
        every rank must decide alike): sums over dp ranks (TP peers counted once), maxima over all;
        p95 is the largest rank's p95, an upper bound."""
        local = exp.context_stats()
        if self.trainer.world_size == 1:
            return local
        lens = exp.seq_lens.double()
        total = self._all_reduce(torch.tensor([float(lens.sum()), float(lens.numel())], dtype=torch.float64), layout)
        top = torch.tensor([local["context_max"], local["context_p95"]], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        n = int(total[1])
        return {"num_seqs": n, "context_mean": float(total[0]) / max(n, 1), "context_max": float(top[0]),
                "context_p95": float(top[1])}

    def _run_stage(self, name: str, stats: dict, fn, timer):
        """Run ``fn(layout)`` under the stage's layout. On an out-of-memory error, callbacks with
        ``on_stage_oom`` (AdaptiveParallelism) may mark that layout infeasible and ask for a retry:
        the stage then runs again under the next layout the selector picks; the step is not lost.

        With several processes, every rank reports after the stage whether it ran out of memory
        (one all-reduce), so that an OOM on one rank is retried by all: safe when the other ranks
        finish the stage without a collective that waits for the failed one (the rollout on
        data-parallel replicas, where the KV cache grows); an OOM before a collective that peers
        are already inside (FSDP's all-gathers in the train stage) still blocks them until the
        process group's timeout."""
        from earl_lightning.parallel.oom import is_oom_error

        retries = 0
        while True:
            err = None
            try:
                with self._stage(name, stats) as layout, timer(name):
                    out = fn(layout)
            except Exception as e:  # noqa: BLE001 - filtered right below
                if not is_oom_error(e):
                    raise
                err = e
            if self._any_rank(err is not None):
                err = err or MemoryError(f"out of memory in stage {name!r} on another rank")
            elif err is None:
                return out
            if retries >= self.max_oom_retries:
                raise err
            handlers = [cb for cb in self.trainer.callbacks if callable(getattr(cb, "on_stage_oom", None))]
            if not any([cb.on_stage_oom(self.trainer, self, name, stats, err) for cb in handlers]):
                raise err
            retries += 1
            self.oom_recoveries += 1
            self._free_after_oom()

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank must call this)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def _free_after_oom(self) -> None:
        import gc

        for opt in self.trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        if self._backend is not None:
            self._backend.release(None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _micro_batch_tokens(self, layout: Layout) -> int:
        """The module's budget, lowered by the layout's when EarlStrategy runs the stage (the
        selector shrinks micro-batches to fit memory)."""
        if callable(getattr(self.trainer.strategy, "stage", None)):
            return min(self.hparams.micro_batch_tokens, layout.micro_batch_tokens)
        return self.hparams.micro_batch_tokens

    def _exchange(self, exp: ExperienceBatch, *, src: Layout, to: Layout) -> ExperienceBatch:
        """Move the batch from the ranks that produced it to the ranks that consume it (one
        all-to-all per dtype). Between equal layouts it only rebalances tokens across dp ranks
        (rows stay put when the load is already within 1%); a no-op in a single process."""
        if self.trainer.world_size == 1:
            return exp
        from earl_lightning.data.dispatcher import Dispatcher

        if self._dispatcher is None:
            self._dispatcher = Dispatcher()
        out = self._dispatcher.exchange(exp, to=to, src=src)
        st = self._dispatcher.last_stats
        for key, name in (("total_bytes", "dispatch/bytes"), ("seconds", "dispatch/seconds"),
                          ("imbalance", "dispatch/imbalance")):
            self._dispatch_stats[name] = self._dispatch_stats.get(name, 0.0) + st[key] if key != "imbalance" \
                else max(self._dispatch_stats.get(name, 0.0), st[key])
        return out

    def _advantages(self, exp: ExperienceBatch, num_groups: int, layout: Layout) -> ExperienceBatch:
        hp = self.hparams
        kl = None
        if self.ref_policy is not None and hp.kl_in_reward:
            kl = exp.pad(get_kl_estimator(hp.kl_estimator)(exp.tokens["old_logprobs"], exp.tokens["ref_logprobs"]), 0.0)
        moments_fn = None
        if self.trainer.world_size > 1:
            from earl_lightning.data.dist_advantages import all_reduce_moments

            def moments_fn(kind, local):  # sums over ranks; TP replicas are counted once
                return all_reduce_moments([local], layout=layout)[0]
        return compute_advantages(exp, estimator=_ESTIMATOR[hp.algorithm], num_groups=num_groups,
                                  grpo_scale=hp.grpo_scale, gamma=hp.gamma, lam=hp.lam, kl=kl,
                                  kl_coef_in_reward=hp.kl_coef if hp.kl_in_reward else 0.0, moments_fn=moments_fn)

    def _update_config(self, micro_batch_tokens: int) -> UpdateConfig:
        hp = self.hparams
        return UpdateConfig(
            ppo_epochs=hp.ppo_epochs, mini_batches=hp.mini_batches, micro_batch_tokens=micro_batch_tokens,
            temperature=hp.temperature, clip_low=hp.clip_low, clip_high=hp.clip_high, loss_agg=hp.loss_agg,
            norm_constant=hp.loss_norm_constant or float(hp.max_context_tokens),
            kl_coef=0.0 if hp.kl_in_reward else hp.kl_coef, kl_estimator=hp.kl_estimator,
            entropy_coef=hp.entropy_coef, value_coef=hp.value_coef, value_clip=hp.value_clip,
            max_grad_norm=hp.max_grad_norm, allowed_token_ids=self.allowed_token_ids,
        )

    def _log_iteration(self, sample_episodes, counts, exp, update, timer, step, layout: Layout) -> None:
        hp = self.hparams
        reduce = lambda t: self._all_reduce(t, layout)  # noqa: E731
        metrics = M.episode_metrics(counts)
        metrics.update(M.context_metrics(exp, reduce))
        metrics.update(timer.metrics(exp, reduce))
        metrics.update(update)
        metrics["logprob/mismatch"] = self._mismatch(exp)
        pop = getattr(self.trainer.strategy, "pop_stage_metrics", None)
        metrics.update(pop() if callable(pop) else {})
        metrics.update(self._dispatch_stats)
        if hasattr(self._backend, "switch_seconds"):
            metrics["rollout/switch_seconds"] = float(self._backend.switch_seconds)
        self._dispatch_stats = {}
        metrics["rl/iteration"] = float(self.rl_iteration)
        metrics["oom/recoveries"] = float(self.oom_recoveries)
        for name in ("reward/mean", "env/win_rate"):
            self.log(name, metrics.pop(name), prog_bar=True, on_step=True, rank_zero_only=True)
        self.log_dict(metrics, on_step=True, rank_zero_only=True)
        if hp.transcript_every_n_steps and step % hp.transcript_every_n_steps == 0 and self.global_rank == 0:
            M.log_transcripts(self.loggers, sample_episodes, step)

    def _mismatch(self, exp: ExperienceBatch) -> float:
        """Max |rollout - recomputed| log-prob over generated tokens of all ranks; warns over the threshold."""
        from earl_lightning.rollout.weight_sync import check_logprob_mismatch, logprob_mismatch

        t = exp.tokens
        value = logprob_mismatch(t["rollout_logprobs"], t["old_logprobs"], t["action_mask"])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        check_logprob_mismatch(value, self.hparams.logprob_mismatch_warn)
        return float(value)

    # ---- evaluation -----------------------------------------------------------------------
    def evaluate(self, specs: list[EpisodeSpec]) -> dict[str, float]:
        """Play ``specs`` greedily; rates over all ranks."""
        sampling = SamplingConfig(**{**vars(self.sampling), "greedy": True, "seed": 0})
        with self._stage("rollout", M.spec_stats(specs, self.hparams.max_new_tokens)) as layout:
            episodes = self._rollout(self._local_specs(specs, layout), sampling, layout)
        counts = self._all_reduce(M.episode_counts(episodes), layout)
        metrics = M.episode_metrics(counts)
        metrics["val/reward"] = metrics.pop("reward/mean")
        return {f"val/{k.split('/', 1)[1]}": v for k, v in metrics.items()}

    def validation_step(self, batch: dict[str, Any], batch_idx: int):
        metrics = self.evaluate(batch["specs"])
        win = metrics.pop("val/win_rate")
        self.log_dict(metrics, on_epoch=True, rank_zero_only=True, batch_size=1)
        self.log("val/win_rate", win, prog_bar=True, on_epoch=True, rank_zero_only=True, batch_size=1)

    def on_train_start(self) -> None:
        # The first evaluation, before any update: the learning curve's baseline at step 0.
        dm = self.trainer.datamodule
        if self.global_step == 0 and dm is not None and getattr(dm, "eval_episodes", 0) and \
                self.trainer.val_dataloaders is not None and self.trainer.limit_val_batches:
            specs = next(iter(dm.val_dataloader()))["specs"]
            metrics = self.evaluate(specs)
            for logger in self.loggers:
                logger.log_metrics(metrics, step=0)

    # ---- checkpointing ----------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["earl"] = {"rl_iteration": self.rl_iteration}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.rl_iteration = checkpoint.get("earl", {}).get("rl_iteration", 0)
        self.configure_model()

"""The warm-start LightningModule: next-token cross-entropy on the assistant tokens of
demonstration transcripts, and a greedy and a sampled evaluation in the environment."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import lightning as L
import torch
from typing_extensions import override

from earl_lightning.algorithms.supervised import soft_token_cross_entropy
from earl_lightning.core.checks import check_count, check_number
from earl_lightning.core.config_groups import coerce, to_dict
from earl_lightning.core.host_memory import apply_host_memory, host_memory_mode
from earl_lightning.core.seeding import run_seed
from earl_lightning.models import eval_mode, load_model, load_tokenizer
from earl_lightning.modules.config import A, RolloutConfig, check_dtype_and_seed
from earl_lightning.modules.metrics import FLAGS, RunMetrics, log_at_global_step, reported
from earl_lightning.modules.rollout_setup import loop_kwargs
from earl_lightning.rollout.backends.hf import HFBackend
from earl_lightning.rollout.loop import rollout
from earl_lightning.rollout.scoring import score_episodes
from earl_lightning.sft.datamodule import DemonstrationDataModule

_SOFT = ("soft_rows", "soft_pos", "soft_owner", "soft_tokens", "soft_probs")


class WarmStartModule(L.LightningModule):
    """Supervised warm start of a causal LM on demonstrations (``earl sft``).

    The loss is the mean next-token cross-entropy over the assistant tokens (the rollout's action
    mask; everything else is labelled -100, as TRL's ``DataCollatorForLanguageModeling`` pads it),
    the same objective as TRL's SFTTrainer with ``assistant_only_loss``; a turn whose demonstration
    policy stated its distribution has its first token trained on that distribution
    (:func:`~earl_lightning.algorithms.supervised.soft_token_cross_entropy`).

    Args:
        model: hub id, local path, or an offline preset (``earl-tiny``) to start from.
        dtype: parameter dtype.
        rollout: the RL recipe's rollout settings (chat, history window, sampling): demonstrations
            are played, and the warm start is evaluated, exactly as the RL run will play.
        lr: AdamW learning rate (linear warmup, then linear decay to 0 over the run).
        weight_decay: AdamW weight decay.
        warmup_steps: optimizer steps of linear warmup.
        seed: seed of the sampled evaluation; null (default): the run's seed (``seed_everything``).
    """

    def __init__(
        self,
        model: str = "earl-tiny",
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        rollout: RolloutConfig = RolloutConfig(),
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.rollout_config = coerce(RolloutConfig, rollout, "--model.rollout")
        check_number("--model.lr", lr, low=0, strict=True)
        check_number("--model.weight_decay", weight_decay, low=0)
        check_count("--model.warmup_steps", warmup_steps, low=0)
        seed = run_seed(seed, f"{A}.seed")
        check_dtype_and_seed(dtype, seed)
        host_memory_mode()  # a bad EARL_HOST_MEMORY fails here, while the run is being built
        self.save_hyperparameters(
            dict(
                model=model,
                dtype=dtype,
                rollout=to_dict(self.rollout_config),
                lr=lr,
                weight_decay=weight_decay,
                warmup_steps=warmup_steps,
                seed=seed,
            )
        )
        self.tokenizer = load_tokenizer(model, "--model.model")
        self.sampling = self.rollout_config.sampling.request(
            self.rollout_config.sampling.token_ids(self.tokenizer)
        )
        self.policy = None
        # the global step of the last evaluation (warm_start.json needs the final one)
        self.evaluated_at_step = -1
        self.greedy_metrics, self.sampled_metrics = RunMetrics(), RunMetrics()

    @override
    def setup(self, stage: str) -> None:
        apply_host_memory()  # freed activations are kept for the next step (earl_lightning/core/host_memory.py)
        dm = self.trainer.datamodule
        if isinstance(dm, DemonstrationDataModule) and not self.greedy_metrics.reward_names:
            for metrics in (self.greedy_metrics, self.sampled_metrics):
                metrics.track_rewards([f.name for f in dm.reward_funcs])

    @override
    def configure_model(self) -> None:
        if self.policy is None:
            self.policy = load_model(self.hparams.model, self.hparams.dtype, "--model.model")
            self.policy.config.use_cache = False
            self.policy.train()

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        opt = torch.optim.AdamW(self.policy.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warm = hp.warmup_steps

        def factor(step: int) -> float:
            return (
                (step + 1) / warm
                if step < warm
                else max(0.0, (total - step) / max(total - warm, 1))
            )

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.policy(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        loss = soft_token_cross_entropy(logits, batch["labels"], *(batch.get(k) for k in _SOFT))
        targets = float((batch["labels"][:, 1:] != -100).sum())
        self.log("sft/loss", loss, prog_bar=True, on_step=True)
        self.log("sft/assistant_tokens", targets, on_step=True, reduce_fx="sum")
        return loss

    # ---- evaluation in the environment -------------------------------------------------------
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Play the held-out specs greedily and sampled (this rank's share of them)."""
        specs = batch["specs"][self.global_rank :: self.trainer.world_size]
        r = self.rollout_config
        backend = HFBackend(
            self.policy, self.tokenizer, reuse_kv=r.reuse_kv, share_prompts=r.share_prompts
        )
        flags = dict.fromkeys(FLAGS, False)
        dm = self.trainer.datamodule
        funcs = dm.reward_funcs if isinstance(dm, DemonstrationDataModule) else []
        kwargs = loop_kwargs(
            r, dm.tools if isinstance(dm, DemonstrationDataModule) else [], continuous=True
        )
        for metrics, greedy in ((self.greedy_metrics, True), (self.sampled_metrics, False)):
            sampling = replace(self.sampling, greedy=greedy, seed=self.hparams.seed)
            with eval_mode(self.policy), torch.no_grad():
                episodes = rollout(specs, backend, self.tokenizer, sampling, **kwargs)
            if kwargs["tools"] is not None and kwargs["tools"].tools:
                for ep in episodes:  # a row's tools, not an environment's: count their use too
                    ep.info.setdefault("tool_calls", ep.tool_calls)
            score_episodes(episodes, funcs, self.tokenizer, timeout_s=r.reward_timeout_s)
            metrics.update_val(episodes, True)
            now = reported(episodes)
            flags = {k: v or now[k] for k, v in flags.items()}
        flags = {
            k: self.trainer.strategy.reduce_boolean_decision(v, all=False) for k, v in flags.items()
        }
        for metrics, prefix in (
            (self.greedy_metrics, "val/"),
            (self.sampled_metrics, "val_sampled/"),
        ):
            for name, metric in metrics.val_objects(flags).items():
                self.log(
                    prefix + name.split("/", 1)[1],
                    metric,
                    prog_bar=name == "val/win_rate",
                    on_step=False,
                    on_epoch=True,
                    batch_size=1,
                )
        log_at_global_step(self)

    @override
    def on_validation_epoch_end(self) -> None:
        self.evaluated_at_step = self.global_step

    def save_pretrained(self, directory: str) -> None:
        """The model and its tokenizer, loadable with ``from_pretrained`` (``--model.model <dir>``)."""
        self.policy.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

"""The rollout stage of :class:`~earl_lightning.modules.rl.AgenticRLModule`: which episodes a step
plays (with dynamic sampling, further draws), how this rank's share of them is played with the
stage's model, the backend and the agents' endpoint, and how they are scored and seeded.

A mixin of the module, as :mod:`earl_lightning.modules.evaluation` is: the evaluation plays its
episodes through the same :meth:`RolloutPlay._play`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from earl_lightning.dispatch.exchange import Exchanger
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.dynamic_sampling import Draws, play_draws
from earl_lightning.modules.rollout_setup import make_backend, play_share, reward_extras
from earl_lightning.rollout.endpoint import EndpointServer
from earl_lightning.rollout.scoring import score_episodes
from earl_lightning.stages import StageContext

if TYPE_CHECKING:  # the class this mixin extends, for type checkers
    from lightning.pytorch import LightningModule as _Module
else:
    _Module = object


class RolloutPlay(_Module):
    """_draw (the step's episodes), _play (this rank's share, played and scored) and their seeds."""

    def _draw(self, step: int, specs: list, num_groups: int, ctx: StageContext) -> Draws:
        """The step's episodes, scored and shaped (``algorithm.overlong``); with dynamic sampling,
        further draws until the batch is full (:mod:`earl_lightning.modules.dynamic_sampling`)."""
        dm, outcomes = self.trainer.datamodule, []

        def play(draw: list, k: int) -> list:
            episodes = self._play(draw, ctx, self._sampling_seed(step, ctx, k))
            self.algorithm_config.overlong.apply(episodes)
            outcomes.append(self._reward_outcomes)
            return episodes

        draws = Draws(num_groups, dm.group_size, self.algorithm_config.dynamic_sampling.max_draws)
        play_draws(play, specs, lambda k: dm.extra_batch(step, k), draws, ctx.reduce.sum_moments)
        self._reward_outcomes = outcomes[0]  # what the functions logged on the step's own batch
        return draws

    def _play(self, specs: list, ctx: StageContext, seed: int, greedy: bool = False) -> list:
        """This rank's share of ``specs``, played with the stage's model (the backend is bound to it)."""
        if self._backend is None:
            hp, policy = self.hparams, ctx.model("policy")
            args = (hp.model, hp.dtype, hp.seed, self.rollout_config, self.local_rank)
            self._backend = make_backend(*args, policy, self.tokenizer)
        self._backend.prepare(ctx.layout, ctx.model("policy"))
        sampling = self.rollout_config.sampling.request(
            self.allowed_token_ids, greedy=greedy, seed=seed
        )
        dm = self.trainer.datamodule
        task = dm if isinstance(dm, EpisodeDataModule) else None
        if task is not None and task.agent is not None and self._endpoint is None:
            self._endpoint = EndpointServer(self.hparams.model).start()
        share = self._exchanger().rollout_share(specs, ctx.layout, self.global_rank)
        try:
            episodes = play_share(
                share,
                self._backend,
                self.tokenizer,
                sampling,
                self.rollout_config,
                ctx.layout,
                tools=task.tools if task is not None else [],
                agent=task.agent if task is not None else None,
                endpoint=self._endpoint,
                scored_elsewhere=bool(self._reward_funcs()),
            )
        finally:
            self._backend.release(None)
        self._reward_outcomes = score_episodes(
            episodes,
            self._reward_funcs(),
            self.tokenizer,
            reward_extras(self.trainer),
            self.rollout_config.reward_timeout_s,
        )
        return episodes

    def _reward_funcs(self) -> list:
        dm = self.trainer.datamodule
        return dm.reward_funcs if isinstance(dm, EpisodeDataModule) else []

    def _exchanger(self) -> Exchanger:
        dm = self.trainer.datamodule
        if not isinstance(dm, EpisodeDataModule):
            raise ValueError(
                "AgenticRLModule trains from an EpisodeDataModule (its episode specs and exchanger); "
                f"got {type(dm).__name__}: pass `datamodule=EpisodeDataModule(...)` to `Trainer.fit`"
            )
        return dm.exchanger

    def _sampling_seed(self, step: int, ctx: StageContext, draw: int = 0) -> int:
        dp_rank = ctx.layout.coords(self.global_rank)[0]
        # draw k > 0: dynamic sampling's further draws of the step
        seed = self.hparams.seed * 1_000_003 + step * 131 + dp_rank + draw * 7_919_777
        return seed % (2**31 - 1)

"""The DataModule: a stream of episode specs, one global RL batch per training step, and the
exchanger that decides where episodes and experience rows live.

A task is rows: the seeds of a built-in environment's episodes, or the rows of a prompt dataset
(TRL's standard or conversational ``prompt`` plus any columns), each played single-turn or, with an
environment, as a multi-turn episode whose ``reset`` gets the row's columns; reward functions with
TRL's signature score them. Every rank sees the same global batch; the DataModule's :class:`~earl_lightning.dispatch.exchange.Exchanger`
gives each rank its share under the rollout layout of the moment (which can change between steps)
and moves experience between stage layouts. Batch ``k`` is a pure function of ``(seed, k)``: a
resumed run picks up at the trainer's restored step and sees exactly the batches an uninterrupted
run would have seen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.core.config_groups import coerce, to_dict
from earl_lightning.core.seeding import run_seed
from earl_lightning.dispatch.exchange import DispatchConfig, Exchanger
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.tasks.agents import Agent, check_agent_columns, describe_agent, resolve_agent
from earl_lightning.tasks.config import (
    OBJECT_SETTINGS,
    DatasetArg,
    EnvKwargs,
    EvalDatasetArg,
    RewardFuncsArg,
    RewardWeightsArg,
    TaskConfig,
    ToolsArg,
)
from earl_lightning.tasks.datasets import RowOrder, Splits
from earl_lightning.tasks.rewards import RewardFunction, check_columns

_SEED_STRIDE = 1_000_003  # keeps training seeds of different steps and eval seeds apart


GROUP_SEEDS = ("shared", "distinct")


def member_seed(base: int, index: int, member: int, group_size: int) -> int:
    """The seed of member ``member`` of the group at position ``index`` of a stream whose groups
    play ``base + index`` under ``group_seeds="shared"``, under ``group_seeds="distinct"``.

    The result is unique per ``(index, member)``, never an eval seed (it lies above ``base``), and
    has the group seed's parity: an OpenSpiel game whose seat alternates with the seed's parity
    gives every member of a group the same seat.
    """
    return base + 2 * (index * group_size + member) + (index & 1)


class EpisodeStream(IterableDataset):
    """Infinite stream of global batches of :class:`EpisodeSpec` in groups of ``group_size``.

    ``group_seeds="shared"``: every member of a group plays the group's seed (the same problem, the
    same opponent moves for the same actions). ``"distinct"``: each member has its own seed of the
    group seed's parity (:func:`member_seed`), so only what the parity fixes is shared.
    """

    def __init__(
        self,
        env: str | None,
        env_kwargs: dict,
        batch_size: int,
        group_size: int,
        seed: int,
        start_step: int = 0,
        group_seeds: str = "shared",
        rows: Any = None,
    ):
        self.env, self.env_kwargs = env, dict(env_kwargs)
        self.batch_size, self.group_size, self.seed = batch_size, group_size, seed
        self.start_step, self.group_seeds = start_step, group_seeds
        self.rows = rows  # a datasets.Dataset: group g of step k plays row order[k * groups + g]
        self.order = RowOrder(len(rows), seed) if rows is not None else None

    def batch(self, step: int) -> list[EpisodeSpec]:
        """The ``batch_size`` specs of step ``step``, group by group: a pure function of the seed
        and the step, so a resumed run replays exactly the episodes it would have played."""
        groups = self.batch_size // self.group_size
        base = (self.seed + 1) * _SEED_STRIDE  # eval uses 0..n-1
        specs = []
        for g in range(groups):
            index = step * groups + g
            row_index = self.order[index] if self.order is not None else -1
            row = self.rows[row_index] if self.rows is not None else None
            for m in range(self.group_size):
                env_seed = (
                    member_seed(base, index, m, self.group_size)
                    if self.group_seeds == "distinct"
                    else base + index
                )
                specs.append(
                    EpisodeSpec(
                        env=self.env,
                        seed=env_seed,
                        group_id=g,
                        episode_id=g * self.group_size + m,
                        env_kwargs=self.env_kwargs,
                        row=row,
                        row_index=row_index,
                    )
                )
        return specs

    def __iter__(self) -> Iterator[dict[str, Any]]:
        step = self.start_step
        while True:
            yield {"step": step, "specs": self.batch(step)}
            step += 1


class EvalEpisodes(IterableDataset):
    """One batch of fixed evaluation seeds (0..n-1: the agent's seat alternates with the seed), or
    of the first ``n`` evaluation rows, each played once (``specs``, greedily) and, with
    ``samples``, that many times more (``sampled``: row ``i``'s samples are group ``i``)."""

    def __init__(
        self,
        env: str | None,
        env_kwargs: dict,
        num_episodes: int,
        rows: Any = None,
        samples: int = 0,
    ):
        self.env, self.env_kwargs, self.rows, self.samples = env, dict(env_kwargs), rows, samples
        self.num_episodes = num_episodes if rows is None else min(num_episodes, len(rows))

    def _spec(self, i: int, episode_id: int) -> EpisodeSpec:
        return EpisodeSpec(
            env=self.env,
            seed=i,
            group_id=i,
            episode_id=episode_id,
            env_kwargs=self.env_kwargs,
            row=self.rows[i] if self.rows is not None else None,
            row_index=i if self.rows is not None else -1,
        )

    def __iter__(self):
        n, k = self.num_episodes, self.samples
        yield {
            "step": -1,
            "specs": [self._spec(i, i) for i in range(n)],
            "sampled": [self._spec(i, i * k + j) for i in range(n) for j in range(k)],
        }


def _identity(batch):
    return batch[0]


class EpisodeDataModule(L.LightningDataModule):
    """Episode specs for agentic RL: an environment's seeds, or a prompt dataset's rows.

    Args:
        env: registered environment name (``connect_four``, ``openspiel``, ``calculator``, ``textarena``,
            ``recall``) or the import path of an Env class or factory (``my_package.envs.GuessGame``).
            With a ``dataset``, each row starts an episode of this environment (its ``reset(seed,
            **columns)`` gets the row's columns); null there: each row is one turn. null without a
            dataset: ``connect_four``.
        env_kwargs: keyword arguments of the environment (e.g. ``{"opponent": "random"}``).
        batch_size: episodes per RL step, over all ranks.
        group_size: episodes per GRPO group. Must divide ``batch_size``.
        group_seeds: what a group's members share. ``"shared"``: the group's seed (the same problem;
            against a random opponent, the same opponent moves wherever the members play alike).
            ``"distinct"``: each member its own seed of the group seed's parity: for the OpenSpiel
            games only the seat (and so the start) is shared and each member's opponent draws its
            own moves, so a near-deterministic policy still sees different games in a group.
        seed: base seed of the training episodes; null (default): the run's seed (``seed_everything``).
        eval_episodes: fixed evaluation seeds played greedily by ``validation_step`` (0 disables).
        eval_env_kwargs: overrides of ``env_kwargs`` for evaluation (e.g. another opponent).
        eval_samples: besides the greedy play, each evaluation row (or seed) is played this many
            times with the training's sampling: ``val/pass@k`` (k = 1, 2, 4, ... and this;
            Chen et al.'s unbiased estimator) and ``val/mean@<n>`` (the samples' mean reward);
            0 (default): greedy only.
        eval_pass_reward: a sampled evaluation episode passes (for ``val/pass@k``) when its
            reward is at least this (1.0: an accuracy reward's right answer, a game's win).
        dispatch: how experience moves between stage layouts (the exchanger's options).
        dataset: the rows to train on: a path or hub id, its settings (``{path, name, data_files,
            train_split, eval_split, eval_size}``), or (Python) a ``datasets.Dataset`` or
            ``DatasetDict``. Each row needs a ``prompt`` (a string, or a list of messages); every
            other column travels with it. A group of ``group_size`` episodes plays one row; the
            rows are visited in epochs, shuffled from ``seed``.
        eval_dataset: (Python) the evaluation rows, a ``datasets.Dataset``; the first
            ``eval_episodes`` of the evaluation rows are played greedily at each validation.
        reward_funcs: reward functions with TRL's signature ``fn(prompts, completions,
            completion_ids, **columns) -> list[float | None]``, by import path
            (``trl.rewards.accuracy_reward``) or (Python) as callables; ``async def`` ones are
            awaited together. Their weighted sum is added to the environment's reward, if any.
        reward_weights: one weight per reward function (null: 1.0 each).
        tools: tools the model may call (TRL's ``tools=``): functions with type hints and a
            docstring, by import path (``my_package.tools.lookup``) or (Python) as callables, or
            ``{schema, fn}`` dicts; every turn's prompt renders them (``apply_chat_template(...,
            tools=...)``), and ``--model.rollout.tool_parser`` reads the model's calls. An
            environment may offer its own (``ToolEnv.tools()``).
        agent: a user's agent, by import path (``my_package.agents.solve``) or (Python) as a
            callable: ``async def agent(client, row, **columns)`` (or a plain def, run on a thread),
            run once per episode with an OpenAI client whose ``base_url`` is the rollout's
            endpoint (one API key per episode). It returns the reward, ``{"reward", "info"}``, or
            None (``reward_funcs`` score the transcript). Plays ``dataset`` rows; no ``env`` or
            ``tools`` beside it (the agent runs its own). See docs/agents.md.

    Raises:
        ValueError: a setting out of range or settings that exclude each other (``batch_size``
            not a multiple of ``group_size``, an ``agent`` beside ``env`` or ``tools``, dataset
            rows without an environment, an agent or a reward function to score them), an unknown
            environment or an import path that does not import, a dataset without the columns the
            task or its reward functions read; named as the ``earl`` command's ``--data.*``
            argument.
    """

    def __init__(
        self,
        env: str | None = None,
        env_kwargs: EnvKwargs = None,
        batch_size: int = 64,
        group_size: int = 8,
        seed: int | None = None,
        eval_episodes: int = 128,
        eval_env_kwargs: EnvKwargs = None,
        dispatch: DispatchConfig = DispatchConfig(),
        group_seeds: str = "shared",
        dataset: DatasetArg = None,
        eval_dataset: EvalDatasetArg = None,
        reward_funcs: RewardFuncsArg = None,
        reward_weights: RewardWeightsArg = None,
        tools: ToolsArg = None,
        agent: str | Callable[..., Any] | None = None,
        eval_samples: int = 0,
        eval_pass_reward: float = 1.0,
    ):
        super().__init__()
        _check_agent_task(agent, env, dataset, tools)
        config = TaskConfig(
            env=env,
            env_kwargs=env_kwargs,
            eval_env_kwargs=eval_env_kwargs,
            dataset=dataset,
            eval_dataset=eval_dataset,
            reward_funcs=reward_funcs,
            reward_weights=reward_weights,
            tools=tools,
            eval_episodes=eval_episodes,
        )
        _check_batch(batch_size, group_size, group_seeds, eval_samples)
        check_number("--data.eval_pass_reward", eval_pass_reward)
        self.seed = seed = run_seed(seed, "--data.seed")
        task = config.open()
        self.env, self.env_kwargs, self.eval_env_kwargs = (
            task.env,
            task.env_kwargs,
            task.eval_env_kwargs,
        )
        self.splits, self.reward_funcs, self.tools = task.splits, task.reward_funcs, task.tools
        self.batch_size, self.group_size = batch_size, group_size
        self.eval_episodes, self.group_seeds = eval_episodes, group_seeds
        self.eval_samples, self.eval_pass_reward = eval_samples, eval_pass_reward
        if self.splits is not None and self.splits.eval is None:
            self.eval_episodes = 0  # no evaluation rows: nothing to evaluate on
        self.agent: Agent | None = None if agent is None else resolve_agent(agent)
        _check_task(self.splits, self.env, self.reward_funcs, self.agent)
        dispatch = coerce(DispatchConfig, dispatch, "--data.dispatch")
        self.exchanger = Exchanger(dispatch)
        env = task.env  # save_hyperparameters reads the locals: the environment and seed played
        self.save_hyperparameters(ignore=["dispatch", *OBJECT_SETTINGS, "agent"])
        self.hparams.update(
            config.hparams(task), dispatch=to_dict(dispatch), agent=describe_agent(agent)
        )

    def first_spec(self) -> EpisodeSpec:
        """The first training episode (step 0, group 0, member 0), whose first prompt the module
        checks against its context budget before anything runs."""
        return self._stream(0).batch(0)[0]

    def extra_batch(self, step: int, k: int) -> list[EpisodeSpec]:
        """Draw ``k`` (1, 2, ...) of more groups for step ``step`` (dynamic sampling): step ``step``
        of a stream of its own, seeded from ``(seed, k)``, so a pure function of ``(seed, step, k)``
        whose rows and seeds differ from the step's own batch."""
        check_count("k", k)
        key = hashlib.sha256(f"earl-extra-draw:{self.seed}:{k}".encode()).digest()
        return self._stream(0, seed=int.from_bytes(key[:8], "big") % (2**31 - 1)).batch(step)

    def _stream(self, start: int, seed: int | None = None) -> EpisodeStream:
        return EpisodeStream(
            self.env,
            self.env_kwargs,
            self.batch_size,
            self.group_size,
            self.seed if seed is None else seed,
            start,
            self.group_seeds,
            rows=self.splits.train if self.splits is not None else None,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        # One RL iteration is one optimizer step of the trainer: a resumed run has its global step
        # restored before this is called, and continues the stream there.
        start = self.trainer.global_step if self.trainer is not None else 0
        return DataLoader(self._stream(start), batch_size=1, collate_fn=_identity, num_workers=0)

    @override
    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """A batch is a step number and episode specs, plain Python with no tensor: nothing to move.
        (Lightning's default walks it and deep-copies every spec, a few milliseconds a step.)"""
        return batch

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_batches(), batch_size=1, collate_fn=_identity, num_workers=0)

    def eval_batches(self) -> EvalEpisodes:
        """The evaluation episodes: seeds 0..n-1, or the first ``eval_episodes`` evaluation rows."""
        args = (self.env, self.eval_env_kwargs, self.eval_episodes)
        if self.splits is None:
            return EvalEpisodes(*args, samples=self.eval_samples)
        rows = self.splits.eval if self.splits.eval is not None else self.splits.train.select([])
        return EvalEpisodes(*args, rows=rows, samples=self.eval_samples)


def _check_agent_task(agent: Any, env: str | None, dataset: Any, tools: Any) -> None:
    """An agent plays dataset rows on its own: no environment or task tools beside it."""
    if agent is None:
        return
    if dataset is None:
        raise ValueError(
            "`--data.agent` plays the rows of a dataset, and `--data.dataset` is null: name the "
            "rows the agent starts from (each row is handed to it as `row`)"
        )
    if env is not None:
        raise ValueError(
            f"`--data.agent` and `--data.env` {env!r} are both set: an agent runs its own "
            "environment (wrap a gymnasium or verifiers env in the agent, or drop `--data.agent`)"
        )
    if tools:
        raise ValueError(
            "`--data.agent` and `--data.tools` are both set: an agent sends its tools with each "
            "request and runs them itself; drop `--data.tools`"
        )


def _check_batch(batch_size: int, group_size: int, group_seeds: str, eval_samples: int) -> None:
    check_count("--data.batch_size", batch_size)
    check_count("--data.group_size", group_size)
    if batch_size % group_size:
        raise ValueError(
            f"`--data.batch_size` ({batch_size}) must be a multiple of `--data.group_size` ({group_size}): "
            f"each GRPO group of {group_size} episodes shares a seed; try batch_size="
            f"{max(group_size, batch_size // group_size * group_size)}"
        )
    check_choice("--data.group_seeds", group_seeds, GROUP_SEEDS)
    check_count("--data.eval_samples", eval_samples, 0)


def _check_task(
    splits: Splits | None, env: str | None, funcs: list[RewardFunction], agent: Agent | None
) -> None:
    """The dataset's columns feed the reward functions (and the agent's parameters), and a row
    played without an environment or an agent needs a reward function to score it."""
    if splits is None:
        return
    check_columns(funcs, splits.columns())
    if agent is not None:
        check_agent_columns(agent, splits.columns())
    elif env is None and not funcs:
        raise ValueError(
            "`--data.reward_funcs` is empty, and `--data.env` is null: rows played without an "
            "environment get their rewards from reward functions only; name at least one "
            "(e.g. trl.rewards.accuracy_reward)"
        )

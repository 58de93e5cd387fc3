"""The warm start's data: demonstration transcripts a scripted policy plays, or the rows of a
dataset in TRL's SFT forms (``prompt``/``completion`` or ``messages``); and the held-out
evaluation episodes (env seeds, or the dataset's evaluation rows scored by reward functions)."""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from typing_extensions import override

from earl_lightning.batches.episodes import supervised_rows
from earl_lightning.core.checks import check_choice, check_count
from earl_lightning.core.seeding import run_seed
from earl_lightning.envs.base import ToolEnv, make_env
from earl_lightning.envs.policies import check_policy_name
from earl_lightning.modules.config import RolloutConfig
from earl_lightning.modules.datamodule import EvalEpisodes
from earl_lightning.modules.metrics import episode_counts
from earl_lightning.modules.rollout_setup import loop_kwargs
from earl_lightning.rollout.chat import ChatDeltas
from earl_lightning.rollout.demonstrations import play_demonstrations_with_targets
from earl_lightning.rollout.process_env import check_env_sendable, check_picklable
from earl_lightning.rollout.transcripts import sft_row
from earl_lightning.rollout.types import EpisodeSpec
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
from earl_lightning.tasks.datasets import CheckedRows
from earl_lightning.tasks.rows import BadRowError, check_sft_row
from earl_lightning.tasks.tools import shown_schema, tool_of

SFT_FORMS = (("prompt", "completion"), ("messages",))

# Demonstration seeds start here: far from the evaluation seeds (0..eval_episodes-1) and from the
# RL training stream's ((seed + 1) * 1_000_003 + ...), so the warm start never sees a held-out game.
_DEMO_SEED_BASE = 500_000_000
_CHUNK = 256  # episodes played per rollout call


def _identity(batch):
    return batch[0]


class SoftTargetCollator:
    """TRL's ``DataCollatorForLanguageModeling`` (``input_ids``, ``attention_mask``, ``labels`` -100
    off the assistant tokens), plus the rows' soft targets flattened: ``soft_rows``, ``soft_pos``
    (the labelled position of each soft target), and per target entry ``soft_owner`` (index into
    them), ``soft_tokens``, ``soft_probs``."""

    def __init__(self, pad_token_id: int) -> None:
        self.inner = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """One padded batch of ``rows``, their soft targets flattened beside it."""
        batch = self.inner([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
        rows_, pos, owner, tokens, probs = [], [], [], [], []
        for i, row in enumerate(rows):
            for p, dist in row.get("soft", ()):
                for token, prob in dist.items():
                    owner.append(len(pos))
                    tokens.append(token)
                    probs.append(prob)
                rows_.append(i)
                pos.append(p)
        batch.update(
            soft_rows=torch.tensor(rows_, dtype=torch.long),
            soft_pos=torch.tensor(pos, dtype=torch.long),
            soft_owner=torch.tensor(owner, dtype=torch.long),
            soft_tokens=torch.tensor(tokens, dtype=torch.long),
            soft_probs=torch.tensor(probs, dtype=torch.float32),
        )
        return batch


def training_rows(
    episodes: list, targets: list[list[dict[int, float] | None]], expected: bool
) -> list[dict[str, Any]]:
    """The supervised rows of ``episodes``: ``input_ids``, ``labels`` (the ids on the assistant
    tokens, -100 elsewhere) and, with ``expected``, ``soft``: ``(position, {token: probability})``
    for each turn whose policy stated its distribution (the turn's first token is then trained on
    that distribution rather than on the token played)."""
    out = []
    for rows, turn_targets in zip(supervised_rows(episodes), targets):
        for row in rows:
            soft = [
                (p, turn_targets[k])
                for k, p in row.heads
                if expected and k < len(turn_targets) and turn_targets[k] is not None
            ]
            out.append(
                {
                    "input_ids": row.input_ids,
                    "soft": soft,
                    "labels": [t if m else -100 for t, m in zip(row.input_ids, row.action_mask)],
                }
            )
    return out


def dataset_training_rows(
    rows: Any,
    tokenizer: Any,
    system_prompt: str | None,
    tools: list[dict[str, Any]] | None = None,
    tool_parser: str | None = None,
) -> list[dict[str, Any]]:
    """The supervised rows of a dataset in TRL's SFT forms (see :func:`~earl_lightning.rollout.transcripts.sft_row`):
    ``input_ids`` and ``labels`` (the ids on the trained tokens, -100 elsewhere); ``tools``: the
    schemas every row is rendered with; ``tool_parser``: the rollout's, which reads each
    structured tool call back from its text. A row that cannot be rendered so is one
    :class:`BadRowError` line naming it."""
    chat, out = ChatDeltas(tokenizer, tools), []
    for i, row in enumerate(rows):
        where = rows.where(i) if isinstance(rows, CheckedRows) else f"`--data.dataset` row {i}"
        try:
            ids, mask = sft_row(row, chat, system_prompt, where, tool_parser)
        except ValueError as err:
            raise BadRowError(str(err)) from None
        out.append(
            {"input_ids": ids, "soft": [], "labels": [t if m else -100 for t, m in zip(ids, mask)]}
        )
    return out


class DemonstrationDataModule(L.LightningDataModule):
    """Transcripts that a scripted policy plays in the environment, or a dataset's rows; one row
    per trained sequence.

    The rows are exactly those the RL trainer makes of its own episodes (one per turn with
    ``history_turns``, else one per episode); the labels are the input ids on the assistant
    tokens and -100 elsewhere, batched by TRL's ``DataCollatorForLanguageModeling``. With a
    ``dataset``, its ``prompt``/``completion`` or ``messages`` rows are rendered by the chat
    template as the rollout renders them (an assistant message's structured ``tool_calls`` as the
    text the model writes for them), and evaluation plays the held-out rows (a ``messages`` row
    from its first user turn: the model plays the rest), scored by ``reward_funcs``.

    Args:
        env: registered environment name or import path (as ``earl fit``'s ``--data.env``). With
            a ``dataset``: its tools (a ``ToolEnv``'s) are rendered with the rows, and a dataset
            without evaluation rows is evaluated on its held-out seeds.
        env_kwargs: keyword arguments of the environment.
        policy: the demonstration policy: ``random_legal``, ``centre_first``,
            ``imperfect_calculator``, or the import path of a callable ``observation -> action``
            (or of a class building one); one with a ``distribution(observation)`` method states
            its distribution over actions (see ``targets``).
        policy_kwargs: keyword arguments of the policy (e.g. ``{no_tool_share: 0.6}``).
        num_episodes: demonstration episodes to play.
        batch_size: rows per optimizer step, over all ranks.
        seed: seed of the demonstration episodes and of the shuffling; null (default): the run's
            seed (``seed_everything``).
        eval_episodes: held-out evaluation seeds 0..n-1, as in ``earl fit`` (0 disables).
        eval_env_kwargs: overrides of ``env_kwargs`` for evaluation.
        targets: ``expected`` (default): where the policy states its distribution over actions
            (``random_legal`` does), the first token of each turn is trained on that distribution:
            the expected loss over the actions the policy would play, of which the sampled action is
            one noisy draw; ``sampled``: on the actions played only (plain SFT on the transcripts).
        dataset: train on a dataset instead of a policy's demonstrations (``policy`` and
            ``num_episodes`` are then unused): as ``earl fit``'s ``--data.dataset``, with rows in
            TRL's SFT forms, ``prompt`` + ``completion`` or ``messages`` (an assistant message
            may carry ``tool_calls`` in TRL's form: they are trained on as the text the chat
            template writes for them, read back by ``--model.rollout.tool_parser``); every row
            once per epoch.
        eval_dataset: (Python) the evaluation rows, a ``datasets.Dataset``.
        reward_funcs: with a ``dataset``, what scores the evaluation (as ``earl fit``'s
            ``--data.reward_funcs``): the held-out rows are played from their prompt, a
            ``messages`` row from its first user turn.
        reward_weights: one weight per reward function (null: 1.0 each).
        tools: tools the model may call, as ``earl fit``'s ``--data.tools``: the demonstrations and
            a dataset's rows are rendered with them (``apply_chat_template(..., tools=...)``).

    Raises:
        ValueError: a setting out of range, an unknown policy, environment or import path, or
            dataset rows in neither SFT form (named as the ``earl sft`` command's ``--data.*``
            argument).
    """

    def __init__(
        self,
        env: str | None = None,
        env_kwargs: EnvKwargs = None,
        policy: str = "random_legal",
        policy_kwargs: dict[str, Any] | None = None,
        num_episodes: int = 1000,
        batch_size: int = 64,
        seed: int | None = None,
        eval_episodes: int = 128,
        eval_env_kwargs: EnvKwargs = None,
        targets: Literal["expected", "sampled"] = "expected",
        dataset: DatasetArg = None,
        eval_dataset: EvalDatasetArg = None,
        reward_funcs: RewardFuncsArg = None,
        reward_weights: RewardWeightsArg = None,
        tools: ToolsArg = None,
    ) -> None:
        super().__init__()
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
        if dataset is None:
            check_policy_name(policy, policy_kwargs, "--data.policy")
        seed = run_seed(seed, "--data.seed")
        check_count("--data.num_episodes", num_episodes)
        check_count("--data.batch_size", batch_size)
        check_choice("--data.targets", targets, ("expected", "sampled"))
        task = config.open(required=SFT_FORMS, check_row=check_sft_row)
        self.env, self.env_kwargs, self.eval_env_kwargs = (
            task.env,
            task.env_kwargs,
            task.eval_env_kwargs,
        )
        self.splits, self.reward_funcs, self.tools = task.splits, task.reward_funcs, task.tools
        env = task.env  # save_hyperparameters reads the locals: the environment and seed played
        self.save_hyperparameters(ignore=list(OBJECT_SETTINGS))
        self.hparams.update(config.hparams(task))
        self.rows: list[dict[str, Any]] | None = None
        self.stats: dict[str, float] = {}

    def row_tools(self, form: str = "full") -> list[dict[str, Any]]:
        """The schemas a dataset's rows are rendered with: ``tools``, then the environment's own
        (a :class:`ToolEnv`), in ``form`` (``--model.rollout.tool_schema``), as the rollout
        renders an episode's."""
        own = []
        if self.env is not None:
            env = make_env(self.env, "--data.env", **self.env_kwargs)
            if isinstance(env, ToolEnv):
                own = [tool_of(t, "the environment's tools") for t in env.tools()]
        return [shown_schema(t.schema, form) for t in [*self.tools, *own]]

    def encode_rows(self, rows: Any, module: Any) -> list[dict[str, Any]]:
        """``rows`` of the dataset as supervised rows, rendered with ``module``'s tokenizer and
        rollout settings (:func:`dataset_training_rows`)."""
        r = module.rollout_config
        return dataset_training_rows(
            rows, module.tokenizer, r.system_prompt, self.row_tools(r.tool_schema), r.tool_parser
        )

    def check_rows(self, module: Any, n: int = 8) -> None:
        """The first ``n`` training rows render as the rollout renders them (their tool calls read
        back with the rollout's parser): a wrong parser or a tool no prompt offers fails before
        any work, as one line."""
        if self.splits is not None:
            train = self.splits.train
            self.encode_rows(train.select(range(min(n, len(train)))), module)

    def check_val_interval(self, trainer: Any, module: Any) -> None:
        """An integer ``val_check_interval`` longer than an epoch, with evaluations counted per
        epoch (Lightning's default ``check_val_every_n_epoch: 1``), fails before any work, naming
        both settings (Lightning's own check comes after the demonstrations are played). An
        epoch's length is exact for a dataset; for demonstrations it is at most one row per
        episode (per turn with ``history_turns``), and only an interval past that is refused
        here."""
        every = trainer.val_check_interval
        if (
            not isinstance(every, int)
            or trainer.check_val_every_n_epoch is None
            or not trainer.limit_val_batches
        ):
            return
        batch, r, n = self.hparams.batch_size, module.rollout_config, self.hparams.num_episodes
        if self.splits is not None:
            rows, bound, what = (
                len(self.splits.train),
                "",
                f"{len(self.splits.train)} training rows",
            )
        else:
            per = 1 if r.history_turns is None else r.max_turns
            rows, bound = n * per, "at most "
            what = f"{n} demonstration episodes, " + (
                f"up to {per} rows each" if per > 1 else "one row each"
            )
        steps = -(-rows // batch)
        limit = trainer.limit_train_batches
        steps = min(steps, limit) if isinstance(limit, int) else max(int(steps * limit), 1)
        if every > steps:
            raise ValueError(
                f"`--trainer.val_check_interval` ({every}) is more steps than one epoch has "
                f"({bound}{steps}: {what}, in batches of {batch}); set "
                f"`--trainer.check_val_every_n_epoch null` to count steps across epochs, or a "
                f"`val_check_interval` of at most {steps}"
            )

    def check_rollout(self, rollout: RolloutConfig) -> None:
        """Settings of the model's rollout and of this data that are valid alone but not together
        (the `earl sft` command checks them before anything runs, as `earl fit` does its own): under
        ``call_isolation: process`` the tools and the environment must reach a worker process.
        Without this check the first rollout (the demonstrations, in ``setup``) found it mid-run."""
        if rollout.call_isolation == "process":
            check_picklable(self.tools)
            if self.env is not None:
                check_env_sendable(self.env)

    def demonstration_specs(self) -> list[EpisodeSpec]:
        """The ``num_episodes`` demonstration episodes, one group each, on seeds of their own
        (past the evaluation and RL training seeds, so the warm start never plays a held-out
        game) that ``seed`` shifts."""
        base = _DEMO_SEED_BASE + self.hparams.seed * self.hparams.num_episodes
        return [
            EpisodeSpec(
                env=self.env, seed=base + i, group_id=i, episode_id=i, env_kwargs=self.env_kwargs
            )
            for i in range(self.hparams.num_episodes)
        ]

    def play(self, module: Any) -> tuple[list, list]:
        """The demonstration episodes, played with ``module``'s tokenizer and rollout settings, and
        their turns' first-token targets."""
        specs, episodes, targets = self.demonstration_specs(), [], []
        kwargs = loop_kwargs(module.rollout_config, self.tools)
        for i in range(0, len(specs), _CHUNK):
            eps, tgt = play_demonstrations_with_targets(
                specs[i : i + _CHUNK],
                self.hparams.policy,
                self.hparams.policy_kwargs,
                module.tokenizer,
                module.sampling,
                **kwargs,
            )
            episodes += eps
            targets += tgt
        return episodes, targets

    @override
    def setup(self, stage: str) -> None:
        if self.rows is not None or stage not in ("fit", None):
            return
        module = self.trainer.lightning_module
        if self.splits is not None:
            self.rows = self.encode_rows(self.splits.train, module)
            self.stats = {
                "demo/rows": float(len(self.rows)),
                "demo/assistant_tokens": float(
                    sum(sum(t != -100 for t in r["labels"]) for r in self.rows)
                ),
            }
            return
        episodes, targets = self.play(module)
        self.rows = training_rows(episodes, targets, self.hparams.targets == "expected")
        counts = episode_counts(episodes)
        n = max(counts["episodes"], 1.0)
        self.stats = {
            "demo/episodes": counts["episodes"],
            "demo/rows": float(len(self.rows)),
            "demo/assistant_tokens": float(
                sum(sum(t != -100 for t in r["labels"]) for r in self.rows)
            ),
            "demo/soft_targets": float(sum(len(r["soft"]) for r in self.rows)),
            "demo/errors": counts["errors"],
            "demo/invalid_rate": counts["invalid"] / n,
        }
        if counts["outcomes"]:
            self.stats.update(
                {"demo/win_rate": counts["wins"] / n, "demo/draw_rate": counts["draws"] / n}
            )
        if not self.rows:
            raise ValueError(
                f"`--data.policy` {self.hparams.policy!r} produced no usable demonstration in "
                f"{len(episodes)} episodes (every one failed in the environment)"
            )

    @override
    def train_dataloader(self) -> DataLoader:
        world = self.trainer.world_size if self.trainer is not None else 1
        if self.hparams.batch_size % world:
            raise ValueError(
                f"`--data.batch_size` ({self.hparams.batch_size}) must be a multiple of the number of "
                f"processes ({world})"
            )
        pad = self.trainer.lightning_module.tokenizer.pad_token_id
        return DataLoader(
            self.rows,
            batch_size=self.hparams.batch_size // world,
            shuffle=True,
            collate_fn=SoftTargetCollator(pad),
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_batches(), batch_size=1, collate_fn=_identity, num_workers=0)

    def eval_batches(self) -> EvalEpisodes:
        """Held-out seeds 0..n-1 (also for a dataset without evaluation rows, when an environment
        is set), or the dataset's first ``eval_episodes`` evaluation rows, each as a row to play
        (:func:`eval_prompt_row`)."""
        held = self.splits.eval if self.splits is not None else None
        if held is None and self.env is not None:
            return EvalEpisodes(self.env, self.eval_env_kwargs, self.hparams.eval_episodes)
        n = min(self.hparams.eval_episodes, len(held)) if held is not None else 0
        rows = [eval_prompt_row(row) for row in held.select(range(n))] if n else []
        return EvalEpisodes(self.env, self.eval_env_kwargs, n, rows=rows)

    def evaluation_note(self) -> str:
        """What the held-out figures (``val/*`` greedy, ``val_sampled/*`` at temperature 1) measure,
        in words, for ``warm_start.json``."""
        batches, tools = self.eval_batches(), [t.name for t in self.tools]
        n, funcs = batches.num_episodes, [f.name for f in self.reward_funcs]
        if batches.rows is None:
            return (
                f"{n} episodes of the environment {self.env!r} on held-out seeds 0..{n - 1}, played "
                f"by the model from the first observation"
            )
        start = (
            "each played from its prompt"
            if "prompt" in self.splits.eval.column_names
            else "each played from its first user turn: the model plays the rest itself"
        )
        with_tools = f", calling the tools {tools}" if tools else ""
        return (
            f"the first {n} evaluation rows of {self.splits.source}, {start}{with_tools}"
            f"{f' in the environment {self.env!r}' if self.env else ''}; scored by {funcs}"
        )


def eval_prompt_row(row: dict[str, Any]) -> dict[str, Any]:
    """An SFT row as a row to play: ``prompt`` kept (its ``completion`` becomes a column), or a
    ``messages`` row's conversation up to its first user message as the prompt. The model plays
    the rest itself (with the task's tools, as an RL run would), so none of the row's own
    assistant turns or tool results is shown to it."""
    if "prompt" in row:
        return row
    messages = row["messages"]
    first = next(
        (i + 1 for i, m in enumerate(messages) if m["role"] == "user"),
        next(i for i, m in enumerate(messages) if m["role"] == "assistant"),
    )
    return {**row, "prompt": messages[:first]}

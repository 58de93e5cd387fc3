"""The run's metrics as torchmetrics: episode outcomes, context lengths, generated tokens; stage
timings are :class:`~earl_lightning.stages.StageTimer`, transcripts :mod:`~earl_lightning.modules.transcripts`.

Every metric synchronizes its states across ranks (sums, maxima), so a multi-process run logs
global values. Ranks of one tensor-parallel group play the same episodes: only TP rank 0 updates
with its episodes (the others update with zeros), so nothing is counted twice. Training-step
values are synchronized on each step (``dist_sync_on_step``); validation metrics are logged as
metric objects, which Lightning computes (and synchronizes) at the end of the validation run.
A rate whose numerator never occurs for the environment (a win rate where episodes have no
outcome) is not shown.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.aggregation import MaxMetric, SumMetric

from earl_lightning.algorithms.moments import STAT_DTYPE, grouped_moments
from earl_lightning.batches.experience import MAX_CONTEXT_STATS, ExperienceBatch

# order of the entries of the count vector
COUNT_KEYS = (
    "episodes",
    "reward_sum",
    "wins",
    "draws",
    "losses",
    "outcomes",
    "invalid",
    "errors",
    "truncated",
    "turns",
    "graded",
    "correct",
    "tool_env",
    "tool_used",
    "tool_choice",
    "right_tool",
)
# metric name -> (numerator, denominator) in COUNT_KEYS
RATES = {
    "reward/mean": ("reward_sum", "episodes"),
    "env/win_rate": ("wins", "episodes"),
    "env/draw_rate": ("draws", "episodes"),
    "env/loss_rate": ("losses", "episodes"),
    "env/invalid_rate": ("invalid", "episodes"),
    "env/truncated_rate": ("truncated", "episodes"),
    "env/turns": ("turns", "episodes"),
    "env/accuracy": ("correct", "episodes"),
    "env/tool_use_rate": ("tool_used", "episodes"),
    "env/right_tool_rate": ("right_tool", "episodes"),
}
# A rate shown only when some episode reported what it counts: game outcomes, graded answers
# (info["correct"]: the calculator), tool calls (info["tool_calls"]), the choice of a tool
# (info["right_tool"]: whether the first tool called was the right one; the inventory task).
REPORTED_BY = {
    "env/win_rate": "outcomes",
    "env/draw_rate": "outcomes",
    "env/loss_rate": "outcomes",
    "env/accuracy": "graded",
    "env/tool_use_rate": "tool_env",
    "env/right_tool_rate": "tool_choice",
}
FLAGS = ("outcomes", "graded", "tool_env", "tool_choice")


class Rate(Metric):
    """``sum(numerator) / sum(denominator)`` over updates and ranks (0 before any denominator)."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("num", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("den", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, num: float, den: float) -> None:
        self.num += num
        self.den += den

    def compute(self) -> torch.Tensor:
        return (self.num / self.den).float() if self.den > 0 else torch.zeros(())


def episode_counts(episodes: Sequence[Any]) -> dict[str, float]:
    c = dict.fromkeys(COUNT_KEYS, 0.0)
    for ep in episodes:
        c["episodes"] += 1
        c["reward_sum"] += ep.reward
        c["wins"] += ep.outcome == "win"
        c["draws"] += ep.outcome == "draw"
        c["losses"] += ep.outcome == "loss"
        c["outcomes"] += ep.outcome is not None
        c["invalid"] += bool(ep.invalid_action)
        c["errors"] += ep.error is not None and getattr(ep, "error_kind", None) in (None, "env")
        c["truncated"] += bool(ep.truncated)
        c["turns"] += ep.num_turns
        info = getattr(ep, "info", None) or {}
        c["graded"] += "correct" in info
        c["correct"] += info.get("correct") is True
        c["tool_env"] += "tool_calls" in info
        c["tool_used"] += (info.get("tool_calls") or 0) > 0
        c["tool_choice"] += "right_tool" in info
        c["right_tool"] += info.get("right_tool") is True
    return c


def reported(episodes: Sequence[Any]) -> dict[str, bool]:
    """Which optional rates these episodes report (see :data:`REPORTED_BY`)."""
    c = episode_counts(episodes)
    return {flag: c[flag] > 0 for flag in FLAGS}


def _episode_metrics(sync_on_step: bool) -> nn.ModuleDict:
    metrics = {name: Rate(dist_sync_on_step=sync_on_step) for name in RATES}
    metrics["env/errors"] = SumMetric(dist_sync_on_step=sync_on_step)
    for flag in FLAGS:  # decide whether the optional rates apply
        metrics[flag] = SumMetric(dist_sync_on_step=sync_on_step)
    return nn.ModuleDict({_key(n): m for n, m in metrics.items()})


def _key(name: str) -> str:
    # ModuleDict keys cannot contain dots; slashes read badly as attributes
    return name.replace("/", "__")


class RunMetrics(nn.Module):
    """The metric objects of a run (children of the LightningModule, so they follow its device)."""

    def __init__(self) -> None:
        super().__init__()
        self.train_episodes = _episode_metrics(sync_on_step=True)
        self.val_episodes = _episode_metrics(sync_on_step=False)
        self.context_mean = Rate(dist_sync_on_step=True)
        self.context_max = MaxMetric(dist_sync_on_step=True)
        self.generated = SumMetric(dist_sync_on_step=True)
        self.tokens = SumMetric(dist_sync_on_step=True)
        self.reward_names: list[str] = []
        self.val_rewards = nn.ModuleList()

    def track_rewards(self, names: Sequence[str]) -> None:
        """Evaluate each of these reward functions too (``val/rewards/<name>``: its mean over the
        evaluation episodes it scored, over every rank). Called once the data (and so the reward
        functions) are known, before the module is placed on its device."""
        self.reward_names = list(names)
        self.val_rewards = nn.ModuleList(Rate(dist_sync_on_step=False) for _ in self.reward_names)

    def step(
        self,
        episodes: Sequence[Any],
        episodes_counted: bool,
        exp: ExperienceBatch,
        rows_counted: bool,
    ) -> dict[str, float]:
        """This training step's global episode and context figures (every rank must call it).
        ``*_counted``: whether this rank's episodes (rollout layout) and experience rows (train
        layout) count, i.e. it is TP rank 0 of its group there."""
        c = episode_counts(episodes if episodes_counted else [])
        out = {
            name: float(m(c[RATES[name][0]], c[RATES[name][1]]))
            for name, m in self._named(self.train_episodes)
            if name in RATES
        }
        out["env/errors"] = float(self.train_episodes[_key("env/errors")](c["errors"]))
        flags = {
            flag: float(self.train_episodes[flag](c[flag])) > 0 for flag in FLAGS
        }  # the step's global counts
        lens = exp.seq_lens.double()
        w = 1.0 if rows_counted else 0.0
        out["context/mean"] = float(
            self.context_mean(w * float(lens.sum()), w * float(lens.numel()))
        )
        out["context/max"] = float(self.context_max(float(lens.max()) if lens.numel() else 0.0))
        out["tokens/generated"] = float(self.generated(w * float(exp.tokens["action_mask"].sum())))
        out["tokens/total"] = float(self.tokens(w * float(exp.num_tokens)))
        return _applicable(out, flags)

    def update_val(self, episodes: Sequence[Any], counted: bool) -> None:
        c = episode_counts(episodes if counted else [])
        for name, m in self._named(self.val_episodes):
            if name in RATES:
                m.update(c[RATES[name][0]], c[RATES[name][1]])
        self.val_episodes[_key("env/errors")].update(c["errors"])
        for flag in FLAGS:
            self.val_episodes[flag].update(c[flag])
        for name, m in zip(self.reward_names, self.val_rewards):
            values = [
                ep.rewards[name] for ep in episodes if counted and ep.rewards.get(name) is not None
            ]
            m.update(math.fsum(values), float(len(values)))

    def val_objects(self, flags: dict[str, bool]) -> dict[str, Metric]:
        """The validation metrics to log (Lightning computes, syncs and resets them); ``flags``:
        which optional rates the evaluation's episodes (of all ranks) report."""
        named = {
            "val/" + name.split("/", 1)[1]: m
            for name, m in self._named(self.val_episodes)
            if name not in FLAGS and flags.get(REPORTED_BY.get(name, ""), True)
        }
        named["val/reward"] = named.pop("val/mean")
        named.update(
            {f"val/rewards/{name}": m for name, m in zip(self.reward_names, self.val_rewards)}
        )
        return named

    def compute_val(self, flags: dict[str, bool]) -> dict[str, float]:
        """The validation values now (synced), then reset: the evaluation before the first update."""
        out = {name: float(m.compute()) for name, m in self.val_objects(flags).items()}
        for m in [*self.val_episodes.values(), *self.val_rewards]:
            m.reset()
        return out

    @staticmethod
    def _named(metrics: nn.ModuleDict) -> Iterator[tuple[str, Metric]]:
        for key, m in metrics.items():
            yield key.replace("__", "/"), m


def log_at_global_step(module: Any) -> None:
    """Log the evaluation being run at the module's ``global_step`` (the optimizer steps done,
    what the progress bar counts), from ``validation_step``: Lightning logs an evaluation inside
    the training loop at the step before (its count is raised after the evaluation), so an
    evaluation after 15 steps would be drawn at 14. A logged ``step`` is the x-axis it uses (the
    same on every rank: synchronized, as Lightning asks of an epoch-level value, by a maximum)."""
    module.log(
        "step",
        float(module.global_step),
        on_step=False,
        on_epoch=True,
        batch_size=1,
        sync_dist=True,
        reduce_fx="max",
    )


def _applicable(values: dict[str, float], flags: dict[str, bool]) -> dict[str, float]:
    return {k: v for k, v in values.items() if flags.get(REPORTED_BY.get(k, ""), True)}


FAILURE_KINDS = {
    "reward": "rewards/errors",
    "unscored": "rewards/unscored",
    "row": "data/skipped_rows",
}


def reward_metrics(
    episodes: Sequence[Any], names: Sequence[str], reduce: Any, prefix: str = "rewards/"
) -> dict[str, float]:
    """Each reward function's mean and std over the episodes it scored (all ranks) and the episodes
    dropped by kind (:data:`FAILURE_KINDS`). Every rank must call it with the same ``names`` (one
    all-reduce)."""
    sums: list[float] = []
    for name in names:
        vals = [ep.rewards[name] for ep in episodes if ep.rewards.get(name) is not None]
        sums += [math.fsum(vals), math.fsum(v * v for v in vals), float(len(vals))]
    sums += [
        float(sum(getattr(ep, "error_kind", None) == k for ep in episodes)) for k in FAILURE_KINDS
    ]
    totals = reduce.sum_floats(sums)
    out = {}
    for i, name in enumerate(names):
        s, ss, n = totals[3 * i : 3 * i + 3]
        mean = s / n if n else 0.0
        out[f"{prefix}{name}/mean"] = mean
        out[f"{prefix}{name}/std"] = math.sqrt(max(ss / n - mean * mean, 0.0)) if n else 0.0
    at = 3 * len(names)
    out.update({metric: totals[at + j] for j, metric in enumerate(FAILURE_KINDS.values())})
    return out


def tool_metrics(episodes: Sequence[Any], reduce: Any) -> dict[str, float]:
    """``tools/calls``, ``tools/errors`` (unknown tool, bad arguments, a failure or time-out, a call
    that could not be read), ``tools/seconds`` (spent in calls, summed) and ``tools/truncated``
    (results cut to ``rollout.max_tool_result_chars``) of the step, over every rank (TP peers
    once). Every rank must call it (one all-reduce)."""
    calls, errors, seconds, truncated = reduce.sum_floats(
        [
            float(sum(ep.tool_calls for ep in episodes)),
            float(sum(ep.tool_errors for ep in episodes)),
            math.fsum(ep.tool_seconds for ep in episodes),
            float(sum(ep.tool_truncated for ep in episodes)),
        ]
    )
    return {
        "tools/calls": calls,
        "tools/errors": errors,
        "tools/seconds": seconds,
        "tools/truncated": truncated,
    }


def logged_by_reward_funcs(outcomes: Sequence[Any], names: Sequence[str]) -> dict[str, float]:
    """The means of what each reward function passed to ``log_metric`` on this rank (logged from
    rank 0 only: a function may log on some ranks and not others, so nothing is reduced)."""
    return {
        f"rewards/{name}/{k}": math.fsum(v) / len(v)
        for name, o in zip(names, outcomes)
        for k, v in o.metrics.items()
        if v
    }


def batch_stats(exp: ExperienceBatch, reduce: Any) -> dict[str, float]:
    """Context statistics of the GLOBAL batch, for the layout selector (which sizes a layout for all
    of it, and every rank must decide alike): sums over dp ranks (TP peers once), maxima over all;
    p95 is the largest rank's p95, an upper bound. ``reduce``: the stage's Reducer."""
    local = exp.context_stats()
    lens = exp.seq_lens.double()
    total, n = reduce.sum_floats([float(lens.sum()), float(lens.numel())])
    keys = MAX_CONTEXT_STATS
    top = reduce.max(torch.tensor([local[k] for k in keys], dtype=torch.float64))
    return {
        "num_seqs": int(n),
        "context_mean": total / max(n, 1),
        **{k: float(v) for k, v in zip(keys, top)},
    }


def zero_spread_share(episodes: Sequence[Any], num_groups: int, reduce: Any) -> float:
    """``reward/zero_std_groups``: the share of the step's groups of two or more episodes (over all
    ranks) whose rewards are all equal, so that GRPO and RLOO give every token of theirs advantage 0
    (TRL logs it as ``frac_reward_zero_std``). ``reduce``: the rollout stage's
    ``Reducer.sum_moments`` (a group's members may be played on different ranks; TP peers count once)."""
    rewards = torch.tensor([float(ep.reward) for ep in episodes], dtype=STAT_DTYPE)
    ids = torch.tensor([ep.spec.group_id for ep in episodes], dtype=torch.long)
    (group,) = reduce([grouped_moments(rewards, ids, num_groups)])
    sized = group.count >= 2
    flat = sized & (group.var() <= 1e-12 * (1.0 + group.mean().abs()))
    return float(flat.sum()) / max(int(sized.sum()), 1)


def episode_metrics(
    episodes: Sequence[Any],
    num_groups: int,
    reduce: Any,
    reward_names: list[str],
    reward_outcomes: list,
    tools: bool,
) -> dict[str, float]:
    """The step's metrics read from its episodes, reduced over the rollout's ranks: the share of
    groups whose rewards are all equal, each reward function's mean (and what the functions
    logged themselves, ``reward_outcomes``), and the tool calls when the task has tools."""
    out = {"reward/zero_std_groups": zero_spread_share(episodes, num_groups, reduce.sum_moments)}
    if tools:
        out.update(tool_metrics(episodes, reduce))
    if reward_names:
        out.update(reward_metrics(episodes, reward_names, reduce))
        out.update(logged_by_reward_funcs(reward_outcomes, reward_names))
    return out

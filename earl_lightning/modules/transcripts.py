"""What a run shows of its episodes, to debug a task: transcripts as TensorBoard text (which
episodes, how many, how often), the first prompt as the model reads it once per run (the system
turn with the tools' schemas, and what they cost in tokens), and every episode as one JSON line
for offline reading (``--dump_episodes``).

A transcript names the episode by what it was made from (an environment and its seed, or the
dataset row's columns), and marks each tool call and each error the model was shown.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from earl_lightning.core.checks import check_choice, check_count
from earl_lightning.core.config_groups import coerce
from earl_lightning.rollout.scoring import is_raw, transcript

EPISODES = ("first", "failed", "best", "worst", "random")
A = "--model.transcripts"
_COLUMN_CHARS = 120  # a row's column shown in a transcript's head, at most
NOT_SHOWN = ("prompt", "messages")  # the row's columns the transcript shows as messages


@dataclass(frozen=True)
class TranscriptConfig:
    """Episode transcripts, logged as TensorBoard text (``transcripts/...``).

    Args:
        every_n_steps: log transcripts every N RL steps (0: never); the first one also logs the
            first prompt as the model reads it (``transcripts/prompt``: the system turn with the
            tools' schemas, and their token count).
        episodes: which of the step's episodes: ``first`` (in batch order), ``failed`` (an error,
            an invalid action, a truncation, a tool error or a reward <= 0), ``best`` / ``worst``
            (highest / lowest reward), ``random`` (drawn from the run's seed and the step).
        n: how many episodes each time.
        dump: a file every episode of every step and evaluation is appended to as one JSON line
            (``earl fit --dump_episodes PATH``; ``phase``: ``train``, ``val``, or ``sanity`` for
            Lightning's sanity check; each further process writes ``PATH.rank<k>``); null: none.
    """

    every_n_steps: int = 10
    episodes: Literal["first", "failed", "best", "worst", "random"] = "first"
    n: int = 2
    dump: str | None = None

    def __post_init__(self) -> None:
        check_count(f"{A}.every_n_steps", self.every_n_steps, low=0)
        check_choice(f"{A}.episodes", self.episodes, EPISODES)
        check_count(f"{A}.n", self.n)

    def due(self, step: int) -> bool:
        return bool(self.every_n_steps) and step % self.every_n_steps == 0


def failed(ep: Any) -> bool:
    return bool(
        ep.error is not None
        or ep.invalid_action
        or ep.truncated
        or ep.tool_errors
        or ep.reward <= 0
    )


def pick(episodes: Sequence[Any], config: TranscriptConfig, seed: int) -> list[Any]:
    """The episodes ``config.episodes`` chooses, ``config.n`` at most, in the order shown."""
    n, how = config.n, config.episodes
    if how == "failed":
        return [ep for ep in episodes if failed(ep)][:n]
    if how in ("best", "worst"):
        return sorted(episodes, key=lambda ep: ep.reward, reverse=how == "best")[:n]
    if how == "random":
        return random.Random(seed).sample(list(episodes), min(n, len(episodes)))
    return list(episodes[:n])


def _head(ep: Any) -> str:
    """What the episode was made from, and how it went."""
    spec, parts = ep.spec, []
    if spec.env is not None:
        parts.append(f"**env** {spec.env} **seed** {spec.seed}")
    if spec.row is not None:
        cols = ", ".join(
            f"{k}=`{json.dumps(v, default=str)[:_COLUMN_CHARS]}`"
            for k, v in spec.row.items()
            if k not in NOT_SHOWN
        )
        parts.append(f"**row** {spec.row_index}" + (f": {cols}" if cols else ""))
    parts.append(f"**reward** {ep.reward:+.2f}")
    if ep.rewards:
        parts.append(
            "("
            + ", ".join(f"{k} {'-' if v is None else f'{v:+.2f}'}" for k, v in ep.rewards.items())
            + ")"
        )
    if ep.outcome is not None:
        parts.append(f"**outcome** {ep.outcome}")
    parts.append(f"**turns** {ep.num_turns}")
    if ep.tool_calls or ep.tool_errors:
        parts.append(f"**tool calls** {ep.tool_calls} (**{ep.tool_errors} failed**)")
    for flag in ("invalid_action", "truncated"):
        if getattr(ep, flag):
            parts.append(f"**{flag.replace('_', ' ')}**")
    if ep.error is not None:
        parts.append(f"\n\n**ERROR** ({ep.error_kind}): {ep.error}")
    return " ".join(parts)


def _block(text: str) -> str:
    return "    " + (text or "").replace("\n", "\n    ")


def format_transcript(ep: Any) -> str:
    """The episode as Markdown: its head, then each message; an assistant turn that called tools
    names the calls, a tool's answer that is an error is marked."""
    lines, turn = [_head(ep)], 0
    for m in ep.messages:
        label = f"**{m['role']}**"
        if m["role"] == "assistant":
            calls = ep.turn_calls[turn] if turn < len(ep.turn_calls) else []
            if calls:
                label += " calls " + ", ".join(
                    f"`{c.name}({json.dumps(c.arguments)[:_COLUMN_CHARS]})`" for c in calls
                )
            turn += 1
        elif m["role"] == "tool":
            label = f"**tool** `{m.get('name', '')}`"
            if str(m.get("content", "")).startswith("Error:"):
                label += " **ERROR**"
        lines.append(f"{label}:\n\n{_block(m.get('content'))}")
    return "\n\n".join(lines)


def format_prompt(ep: Any, tokenizer: Any) -> str:
    """The episode's first prompt as the model reads it, with its token count and, when the
    prompt offers tools, how many of those tokens their schemas take (the prompt less the same
    messages rendered without tools)."""
    ids = list(ep.token_ids[: ep.prompt_tokens])
    head = f"The first prompt, as the model reads it: {len(ids)} tokens"
    if not is_raw(ep):
        first = next(
            (i for i, m in enumerate(ep.messages) if m["role"] == "assistant"), len(ep.messages)
        )
        bare = tokenizer.apply_chat_template(
            ep.messages[:first], tokenize=False, add_generation_prompt=True
        )
        cost = len(ids) - len(tokenizer.encode(bare, add_special_tokens=False))
        if cost > 0:
            head += f", of which the tools' schemas take {cost}"
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return f"{head}.\n\n{_block(text)}"


def log_text(loggers: Sequence[Any], tag: str, text: str, step: int) -> None:
    """``text`` as TensorBoard text (loggers that are not TensorBoard's are skipped)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=step)


def dump_path(path: str, rank: int) -> Path:
    """Where process ``rank`` writes its episodes: ``path`` for rank 0, ``path.rank<k>`` else."""
    return Path(path) if rank == 0 else Path(f"{path}.rank{rank}")


def episode_record(ep: Any, tokenizer: Any, step: int, phase: str) -> dict[str, Any]:
    """One episode as plain data: what it was made from, its messages in TRL's form (tool calls
    as ``tool_calls``), its rewards and counts."""
    prompt, completion, _ = transcript(ep, tokenizer)
    spec = ep.spec
    return {
        "step": step,
        "phase": phase,
        "episode_id": spec.episode_id,
        "group_id": spec.group_id,
        "env": spec.env,
        "seed": spec.seed,
        "row_index": spec.row_index if spec.row is not None else None,
        "row": spec.row,
        "prompt": prompt,
        "completion": completion,
        "reward": ep.reward,
        "rewards": ep.rewards,
        "outcome": ep.outcome,
        "turns": ep.num_turns,
        "invalid_action": ep.invalid_action,
        "truncated": ep.truncated,
        "error": ep.error,
        "error_kind": ep.error_kind,
        "tool_calls": ep.tool_calls,
        "tool_errors": ep.tool_errors,
        "info": ep.info,
        "prompt_tokens": ep.prompt_tokens,
        "generated_tokens": ep.num_generated,
    }


def dump_episodes(
    path: Path, episodes: Sequence[Any], tokenizer: Any, step: int, phase: str
) -> None:
    """Append ``episodes`` to ``path`` as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(
        json.dumps(episode_record(ep, tokenizer, step, phase), default=str) + "\n"
        for ep in episodes
    )
    with path.open("a", encoding="utf-8") as f:
        f.write(lines)


def transcript_settings(
    transcripts: TranscriptConfig | dict[str, Any], every_n_steps: int | None
) -> TranscriptConfig:
    """The transcripts group, with the deprecated ``transcript_every_n_steps`` (when given) as
    its ``every_n_steps``, said in a :class:`DeprecationWarning`."""
    config = coerce(TranscriptConfig, transcripts, A)
    if every_n_steps is None:
        return config
    warnings.warn(
        f"`--model.transcript_every_n_steps` is deprecated: use `{A}.every_n_steps` "
        f"({every_n_steps}; `{A}` also chooses which episodes are shown, how many, and a file "
        f"for every episode)",
        EarlDeprecationWarning,
        stacklevel=3,
    )
    check_count("--model.transcript_every_n_steps", every_n_steps, low=0)
    return replace(config, every_n_steps=every_n_steps)


class EarlDeprecationWarning(DeprecationWarning):
    """A setting that still works under its old name; shown by default (Python hides plain
    DeprecationWarnings outside ``__main__``, and a recipe's author would never see it)."""


warnings.simplefilter("default", EarlDeprecationWarning)


class EpisodeLog:
    """What a run shows of its episodes under ``config``: the transcripts due at a step (from
    rank 0's episodes), the first prompt once, and every episode appended to the dump file.
    ``seed``: the run's (``random`` draws from it and the step)."""

    def __init__(self, config: TranscriptConfig, seed: int) -> None:
        self.config, self.seed = config, seed
        self.prompt_shown = False

    def show(
        self,
        episodes: Sequence[Any],
        step: int,
        phase: str,
        loggers: Sequence[Any],
        tokenizer: Any,
        rank: int,
        counted: bool,
    ) -> None:
        """``phase``: ``train``, ``val`` or ``sanity`` (Lightning's sanity check): an evaluation's
        episodes are dumped, not shown;
        ``counted``: whether this rank's episodes count (TP peers play the same ones)."""
        cfg = self.config
        if cfg.dump is not None and counted:
            dump_episodes(dump_path(cfg.dump, rank), episodes, tokenizer, step, phase)
        if phase != "train" or not cfg.due(step) or rank != 0 or not episodes:
            return
        if not self.prompt_shown:
            log_text(loggers, "transcripts/prompt", format_prompt(episodes[0], tokenizer), step)
            self.prompt_shown = True
        chosen = pick(episodes, cfg, seed=self.seed * 1_000_003 + step)
        texts = [format_transcript(ep) for ep in chosen] or [f"no {cfg.episodes} episode"]
        for i, text in enumerate(texts):
            log_text(loggers, f"transcripts/{cfg.episodes}_{i}", text, step)

"""Metrics of an RL iteration: episode outcomes, context lengths, stage timings, transcripts.

Counts are summed over ranks by the caller (one all-reduce of a small tensor), so every rate is
over the whole batch, not rank 0's share.
"""

from __future__ import annotations

import contextlib
import time

import torch

from earl_lightning.data.experience import ExperienceBatch

# order of the entries of the count vector
_COUNT_KEYS = ("episodes", "reward_sum", "wins", "draws", "losses", "invalid", "errors", "truncated", "turns")


def spec_stats(specs, gen_len: int) -> dict:
    return {"num_seqs": len(specs), "gen_len": gen_len}


def episode_counts(episodes) -> torch.Tensor:
    c = dict.fromkeys(_COUNT_KEYS, 0.0)
    for ep in episodes:
        c["episodes"] += 1
        c["reward_sum"] += ep.reward
        c["wins"] += ep.outcome == "win"
        c["draws"] += ep.outcome == "draw"
        c["losses"] += ep.outcome == "loss"
        c["invalid"] += bool(ep.invalid_action)
        c["errors"] += ep.error is not None
        c["truncated"] += bool(ep.truncated)
        c["turns"] += ep.num_turns
    return torch.tensor([c[k] for k in _COUNT_KEYS], dtype=torch.float64)


def episode_metrics(counts: torch.Tensor) -> dict[str, float]:
    c = dict(zip(_COUNT_KEYS, counts.tolist()))
    n = max(c["episodes"], 1.0)
    return {
        "reward/mean": c["reward_sum"] / n,
        "env/win_rate": c["wins"] / n,
        "env/draw_rate": c["draws"] / n,
        "env/loss_rate": c["losses"] / n,
        "env/invalid_rate": c["invalid"] / n,
        "env/errors": c["errors"],
        "env/truncated_rate": c["truncated"] / n,
        "env/turns": c["turns"] / n,
    }


def context_metrics(exp: ExperienceBatch, all_reduce) -> dict[str, float]:
    lens = exp.seq_lens.double()
    s = all_reduce(torch.tensor([float(lens.sum()), float(lens.numel())], dtype=torch.float64))
    mx = torch.tensor([float(lens.max()) if lens.numel() else 0.0], dtype=torch.float64)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX)
    return {"context/mean": float(s[0] / max(s[1], 1.0)), "context/max": float(mx[0])}


class StageTimer:
    """Wall time per stage, and tokens/s of each stage over the iteration's tokens."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, exp: ExperienceBatch, all_reduce) -> dict[str, float]:
        gen = float(exp.tokens["action_mask"].sum())
        tot = float(exp.num_tokens)
        gen, tot = all_reduce(torch.tensor([gen, tot], dtype=torch.float64)).tolist()
        out = {}
        for name, sec in self.seconds.items():
            out[f"stage/{name}/seconds"] = sec
            # rollout throughput counts generated tokens; the other stages process every token
            out[f"stage/{name}/tokens_per_s"] = (gen if name == "rollout" else tot) / max(sec, 1e-9)
        return out


def format_transcript(ep) -> str:
    head = (f"**env** {ep.spec.env} **seed** {ep.spec.seed} **reward** {ep.reward:+.2f} "
            f"**outcome** {ep.outcome} **turns** {ep.num_turns} **invalid** {ep.invalid_action}")
    body = "\n\n".join(f"**{m['role']}**:\n\n    " + m["content"].replace("\n", "\n    ") for m in ep.messages)
    return head + "\n\n" + body


def log_transcripts(loggers, episodes, step: int) -> None:
    for logger in loggers:
        writer = getattr(logger, "experiment", None)
        if hasattr(writer, "add_text"):
            for i, ep in enumerate(episodes):
                writer.add_text(f"transcripts/episode_{i}", format_transcript(ep), global_step=step)

"""The experience batch: packed (unpadded) per-token tensors plus per-sequence fields.

Per-token fields are 1-D tensors of length ``num_tokens`` laid end to end; sequence ``i`` owns
``[cu_seqlens[i], cu_seqlens[i+1])``. Token-level conventions (shared by every stage):

- ``input_ids[t]``: the token; ``action_mask[t] = 1`` iff the policy generated it.
- ``*logprobs[t]``: log-prob of ``input_ids[t]`` given the tokens before it (0 where mask is 0).
- ``advantages[t]``, ``returns[t]``, ``values[t]``: per generated token.

Per-sequence fields are 1-D tensors of length ``num_seqs``: ``rewards``, ``group_ids``,
``episode_ids``, ``truncated``, ``num_turns`` and anything else an algorithm adds.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from earl_lightning.core.checks import check_count

TOKEN_FIELDS_REQUIRED = ("input_ids", "action_mask")
SEQ_FIELDS_REQUIRED = ("rewards", "group_ids", "episode_ids")

# The statistics of :meth:`ExperienceBatch.context_stats` that combine over ranks by their maximum
MAX_CONTEXT_STATS = (
    "context_max",
    "context_p95",
    "prompt_max",
    "turn_prefill_max",
    "scored_max",
    "scored_share_max",
)


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int64 offsets of sequences of these lengths packed end to end, from 0."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    return cu


@dataclass
class ExperienceBatch:
    cu_seqlens: torch.Tensor  # [S+1] int64, cu_seqlens[0] == 0
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)  # each [N]
    seqs: dict[str, torch.Tensor] = field(default_factory=dict)  # each [S]

    def __post_init__(self) -> None:
        self.validate()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_sequences(
        cls, token_fields: dict[str, list[torch.Tensor]], seq_fields: dict[str, torch.Tensor]
    ):
        lengths = [len(t) for t in next(iter(token_fields.values()))]
        cu = cu_seqlens_of(lengths)
        tokens = {}
        for name, parts in token_fields.items():
            if len(parts) != len(lengths):
                raise ValueError(
                    f"token field {name!r} has {len(parts)} sequences, expected {len(lengths)}"
                )
            tokens[name] = torch.cat(parts) if parts else torch.zeros(0)
        return cls(cu, tokens, dict(seq_fields))

    @classmethod
    def empty_like(cls, other: ExperienceBatch) -> ExperienceBatch:
        return other.select(torch.zeros(0, dtype=torch.long))

    def validate(self) -> None:
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must be 1-D and start at 0, got {cu.tolist()[:8]}")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        n, s = int(cu[-1]), cu.numel() - 1
        for name, t in self.tokens.items():
            if t.dim() != 1 or t.numel() != n:
                raise ValueError(
                    f"token field {name!r} has shape {tuple(t.shape)}, expected ({n},) to match cu_seqlens"
                )
        for name, t in self.seqs.items():
            if t.dim() != 1 or t.numel() != s:
                raise ValueError(
                    f"sequence field {name!r} has shape {tuple(t.shape)}, expected ({s},): one value per sequence"
                )
        if "rewards" in self.seqs and s:
            bad = ~torch.isfinite(self.seqs["rewards"].double())
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                ep = int(self.seqs["episode_ids"][i]) if "episode_ids" in self.seqs else i
                raise ValueError(
                    f"reward of episode {ep} is {float(self.seqs['rewards'][i])}; rewards must be finite"
                )

    # ---- shape ---------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def __len__(self) -> int:
        return self.num_seqs

    def token_seq_index(self) -> torch.Tensor:
        """[N] index of the sequence each token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_seqs), self.seq_lens)

    def token_offsets(self) -> torch.Tensor:
        """[N] each token's position inside its own sequence (0 at every sequence's start)."""
        return torch.arange(self.num_tokens) - torch.repeat_interleave(
            self.cu_seqlens[:-1], self.seq_lens
        )

    # ---- selection -----------------------------------------------------------------------
    def select(self, indices) -> ExperienceBatch:
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        lens = self.seq_lens[idx]
        cu = torch.zeros(idx.numel() + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens, 0)
        pos = self.token_positions(idx)
        return ExperienceBatch(
            cu,
            {k: v[pos] for k, v in self.tokens.items()},
            {k: v[idx] for k, v in self.seqs.items()},
        )

    def token_positions(self, indices) -> torch.Tensor:
        """[n] positions in the packed token fields of the tokens of sequences ``indices``, in order."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        lens = self.seq_lens[idx]
        starts = self.cu_seqlens[:-1][idx]
        first = torch.cumsum(lens, 0) - lens  # where each chosen sequence starts in the output
        offs = torch.arange(int(lens.sum())) - torch.repeat_interleave(first, lens)
        return torch.repeat_interleave(starts, lens) + offs

    @staticmethod
    def concat(batches: list[ExperienceBatch]) -> ExperienceBatch:
        if not batches:
            raise ValueError("concat needs at least one batch")
        keys_t, keys_s = set(batches[0].tokens), set(batches[0].seqs)
        for b in batches[1:]:
            if set(b.tokens) != keys_t or set(b.seqs) != keys_s:
                raise ValueError(
                    f"cannot concat batches with different fields: {sorted(keys_t | keys_s)} vs "
                    f"{sorted(set(b.tokens) | set(b.seqs))}"
                )
        lens = torch.cat([b.seq_lens for b in batches])
        cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens, 0)
        return ExperienceBatch(
            cu,
            {k: torch.cat([b.tokens[k] for b in batches]) for k in batches[0].tokens},
            {k: torch.cat([b.seqs[k] for b in batches]) for k in batches[0].seqs},
        )

    def micro_batch_indices(self, max_tokens: int) -> list[list[int]]:
        """Sequence indices of consecutive micro-batches whose padded size (rows x longest row)
        stays within ``max_tokens``. Sequences are sorted by length first so padding stays small;
        a sequence longer than the budget gets a micro-batch of its own."""
        check_count("micro_batch_tokens", max_tokens)
        order = torch.argsort(self.seq_lens, descending=True, stable=True).tolist()
        lens = self.seq_lens.tolist()
        out, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * lens[cur[0]] > max_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        return out + ([cur] if cur else [])

    def split_by_tokens(self, max_tokens: int) -> list[ExperienceBatch]:
        """The micro-batches of :meth:`micro_batch_indices` as batches."""
        return [self.select(idx) for idx in self.micro_batch_indices(max_tokens)]

    # ---- model input ---------------------------------------------------------------------
    def padded(self, name: str, pad_value=0) -> torch.Tensor:
        """[S, L] right-padded view of a per-token field (L = longest sequence)."""
        return self.pad(self.tokens[name], pad_value)

    def pad(self, t: torch.Tensor, pad_value=0) -> torch.Tensor:
        """[N] per-token values laid out like this batch -> [S, L], right-padded."""
        lens = self.seq_lens
        width = int(lens.max()) if lens.numel() else 0
        out = torch.full((self.num_seqs, width), pad_value, dtype=t.dtype, device=t.device)
        rows = self.token_seq_index().to(t.device)
        cols = self.token_offsets().to(t.device)
        out[rows, cols] = t
        return out

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`padded`: [S, L] -> [N]."""
        rows = self.token_seq_index().to(padded.device)
        cols = self.token_offsets().to(padded.device)
        return padded[rows, cols]

    def to(self, device) -> ExperienceBatch:
        return ExperienceBatch(
            self.cu_seqlens,
            {k: v.to(device) for k, v in self.tokens.items()},
            {k: v.to(device) for k, v in self.seqs.items()},
        )

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in [*self.tokens.values(), *self.seqs.values()]
        )

    def context_stats(self) -> dict[str, float]:
        """The sequences' lengths, for the memory model, and what an HF rollout with a KV cache
        kept between turns encodes per call: ``prompt_max``, the longest first prompt, and
        ``turn_prefill_max``, the longest later run of tokens the policy did not generate (a turn's
        observation and template, or a whole-chat turn's prompt) plus the last sampled token; and
        what the scored last layer runs at: ``scored_max``, the most scored positions of a sequence,
        and ``scored_share_max``, the largest share of its length they make (:meth:`scored_counts`)."""
        lens = self.seq_lens.double()
        if lens.numel() == 0:
            return dict.fromkeys(("num_seqs", "context_mean", *MAX_CONTEXT_STATS), 0.0)
        prompt, turn = self.prompt_runs()
        scored = self.scored_counts().double()
        return {
            "scored_max": float(scored.max()),
            "scored_share_max": float((scored / lens.clamp_min(1)).max()),
            "num_seqs": int(lens.numel()),
            "context_mean": float(lens.mean()),
            "context_max": float(lens.max()),
            "context_p95": float(torch.quantile(lens, 0.95)),
            "prompt_max": float(prompt),
            "turn_prefill_max": float(min(float(lens.max()), turn + 1)) if turn else 0.0,
        }

    def scored_counts(self) -> torch.Tensor:
        """[S] the positions of each sequence whose logits score an action token: its action tokens
        after the first position (train/scored.py)."""
        mask = (self.tokens["action_mask"] > 0).long().cpu()
        counts = torch.zeros(self.num_seqs, dtype=torch.long).index_add_(
            0, self.token_seq_index().cpu(), mask
        )
        starts, nonempty = self.cu_seqlens[:-1], self.seq_lens > 0
        counts[nonempty] -= mask[starts[nonempty]]
        return counts

    def prompt_runs(self) -> tuple[int, int]:
        """(longest first prompt, longest later run) of consecutive ``action_mask == 0`` tokens. A
        first prompt opens the first row of its episode; a row of a later turn continues one."""
        prompt = (self.tokens["action_mask"] == 0).cpu()
        if not bool(prompt.any()):
            return 0, 0
        starts = prompt.clone()
        starts[1:] &= ~prompt[:-1]  # a run starts after a generated token ...
        seq_starts = self.cu_seqlens[:-1]
        nonempty = self.seq_lens > 0
        starts[seq_starts[nonempty]] = prompt[seq_starts[nonempty]]  # ... or where a row starts
        run = torch.cumsum(starts.long(), 0) - 1
        lengths = torch.bincount(run[prompt])
        first = torch.zeros(lengths.numel(), dtype=torch.bool)  # the runs that open an episode
        seen: set[int] = set()
        episodes = (
            self.seqs["episode_ids"].tolist()
            if "episode_ids" in self.seqs
            else range(self.num_seqs)
        )
        for row, (start, ep) in enumerate(zip(seq_starts.tolist(), episodes)):
            if nonempty[row] and ep not in seen and bool(prompt[start]):
                first[run[start]] = True
            seen.add(ep)
        return tuple(int(lengths[sel].max()) if bool(sel.any()) else 0 for sel in (first, ~first))

    # ---- dtype grouping (what the dispatcher packs into one buffer per dtype) ----------------
    def schema(self) -> tuple[FieldSpec, ...]:
        """Every field as a :class:`FieldSpec`: token fields by name, then sequence fields by name."""
        return (
            *(FieldSpec(k, "token", self.tokens[k].dtype) for k in sorted(self.tokens)),
            *(FieldSpec(k, "seq", self.seqs[k].dtype) for k in sorted(self.seqs)),
        )

    @classmethod
    def empty(cls, schema: tuple[FieldSpec, ...]) -> ExperienceBatch:
        """A batch with no sequences and the given fields (what a rank that produced nothing holds)."""
        tokens = {f.name: torch.zeros(0, dtype=f.dtype) for f in schema if f.kind == "token"}
        seqs = {f.name: torch.zeros(0, dtype=f.dtype) for f in schema if f.kind == "seq"}
        return cls(torch.zeros(1, dtype=torch.long), tokens, seqs)


# Dtypes every torch.distributed backend (gloo, NCCL) moves natively; anything else (int16, uint16,
# float8 ...) travels as its raw bytes, which is exact because the receiver views them back.
WIRE_DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)


@dataclass(frozen=True)
class FieldSpec:
    """One field of an :class:`ExperienceBatch`: its name, whether it is per token or per sequence,
    and its dtype."""

    name: str
    kind: Literal["token", "seq"]
    dtype: torch.dtype

    @property
    def wire(self) -> torch.dtype:
        """The dtype this field travels as."""
        return self.dtype if self.dtype in WIRE_DTYPES else torch.uint8

    @property
    def width(self) -> int:
        """Wire elements per value (1, or the itemsize when the field travels as bytes)."""
        return 1 if self.dtype in WIRE_DTYPES else torch.empty(0, dtype=self.dtype).element_size()

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return (
            t if self.width == 1 and self.wire == self.dtype else t.contiguous().view(torch.uint8)
        )

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.wire == self.dtype else t.view(self.dtype)


def group_by_wire_dtype(schema: tuple[FieldSpec, ...]) -> dict[torch.dtype, list[FieldSpec]]:
    """Fields grouped by the dtype they travel as, groups in a fixed order (the order of
    ``WIRE_DTYPES``) so every rank packs and unpacks identical layouts."""
    groups: dict[torch.dtype, list[FieldSpec]] = {}
    for dt in WIRE_DTYPES:
        members = [f for f in schema if f.wire == dt]
        if members:
            groups[dt] = members
    return groups


def schema_fingerprint(schema: tuple[FieldSpec, ...]) -> int:
    """A 31-bit checksum of field names, kinds and dtypes: ranks compare it before they exchange."""
    text = ";".join(f"{f.kind}:{f.name}:{f.dtype}" for f in schema)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def describe_schema(schema: tuple[FieldSpec, ...]) -> str:
    return (
        ", ".join(f"{f.name}[{f.kind}]:{str(f.dtype).removeprefix('torch.')}" for f in schema)
        or "(no fields)"
    )

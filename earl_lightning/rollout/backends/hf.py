"""Generation with a transformers causal LM, keeping each episode's KV cache between turns.

With ``reuse_kv=True`` turn t prefills only the tokens added since turn t-1 (the previous
turn's last generated token, the env's observation, the chat scaffolding): the episode's cached
keys/values for turns 1..t-1 are reused, from the previous call's batched buffer as a whole when
every request continues one of its rows, else packed anew per row (see :mod:`.kv`).
``reuse_kv=False`` is the reference path: the same batched forward, with every turn re-encoding
its whole context. Both draw identical tokens for a given seed.

With ``share_prompts=True`` requests of one call that carry the same whole prompt and no cache (a
GRPO group's first turn) prefill it once: the distinct prompts but their last token go through a
small batch first, and each request then continues from a copy of that cache like a later turn.

With ``prefill_tail=True`` a prefill runs the last decoder layer's query, attention, output
projection and MLP at the last column only, where the logits are read (see :mod:`.prefill_tail`).
With ``direct_decode=True`` a decode step runs the model's modules without transformers' per-call
wrapping, where nothing hangs on those calls (see :mod:`.decode_step`); in a full-attention model
its mask is one [B, capacity] row kept from step to step rather than rebuilt each step.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from earl_lightning.core.checks import check_count
from earl_lightning.models import eval_mode
from earl_lightning.rollout.backends.base import (
    GenOutput,
    GenRequest,
    SamplingConfig,
    check_requests,
)
from earl_lightning.rollout.backends.decode_step import (
    can_decode_direct,
    decode_logits,
    decode_parts,
    has_dtensor,
    rotary_table,
    step_masks,
)
from earl_lightning.rollout.backends.kv import (
    EpisodeKV,
    ResidentKV,
    attention_masks,
    attention_windows,
    build_cache,
    common_resident,
    gqa_attention,
)
from earl_lightning.rollout.backends.prefill_tail import last_column_only
from earl_lightning.rollout.backends.sampling import (
    draw_uniforms,
    row_seed,
    sample_tokens,
    stop_hits,
)


@dataclass
class _Batch:
    """Column layout of one ``generate`` call (see :mod:`.kv`)."""

    prefix_cols: int  # widest reused prefix
    decode_start: int  # first decode column = prefix_cols + widest suffix
    capacity: int
    valid: torch.Tensor  # [B, capacity] bool: column holds a real token of that row
    suffix_ids: torch.Tensor  # [B, S] left-padded new tokens
    suffix_pos: torch.Tensor  # [B, S] their true positions (0 under padding)
    next_pos: torch.Tensor  # [B] position of the first generated token (= prompt length)


class HFBackend:
    """Batched multi-turn generation with a transformers causal LM on the model's device.

    Args:
        model: a decoder-only ``AutoModelForCausalLM`` (Qwen2, Llama, ...) with full and/or sliding-window
            attention layers.
        tokenizer: its tokenizer (eos, pad, stop-string decoding, and the decodable vocabulary).
        reuse_kv: keep each episode's KV cache between calls and prefill only the new suffix;
            ``False`` re-encodes the whole context every call (the reference path).
        prefill_chunk_elems: bound on batch x query x key elements per prefill forward; long
            prefills are split along the query axis so the attention mask stays small.
        share_prompts: encode a prompt that several requests of one call share (and none has
            cached) once; ``False`` encodes it for each.
        reuse_buffer: take the previous call's KV buffer whole as the prefix when every request
            continues one of its rows (and holes would not make it much wider than the longest
            row); ``False`` packs every episode's cached KV anew on each call.
        gqa_decode_rows: in a decode step, attend with the query heads that share a KV head as
            query rows of it, so each cached KV head is read once (``False``: SDPA's ``enable_gqa``).
        decode_matmul: on CPU, attend those rows with two matrix products (scores, then values)
            rather than SDPA's kernel, which is slower there for a few query rows.
        prefill_tail: in a prefill, run the last decoder layer past its keys and values at the
            last column only (Llama-pattern layers with full attention; others run it whole).
        direct_decode: run a decode step through the model's modules without transformers'
            per-call wrapping (:mod:`.decode_step`; where it applies, else the model's forward).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        reuse_kv: bool = True,
        prefill_chunk_elems: int = 1 << 24,
        share_prompts: bool = True,
        reuse_buffer: bool = True,
        gqa_decode_rows: bool = True,
        decode_matmul: bool = True,
        prefill_tail: bool = True,
        direct_decode: bool = True,
    ):
        check_count("prefill_chunk_elems", prefill_chunk_elems)
        self.model, self.tokenizer = model, tokenizer
        self._tensor_parallel = has_dtensor(model)
        self.reuse_kv, self.prefill_chunk_elems, self.share_prompts = (
            reuse_kv,
            prefill_chunk_elems,
            share_prompts,
        )
        self.reuse_buffer, self.gqa_decode_rows = reuse_buffer, gqa_decode_rows
        self.prefill_tail, self.decode_matmul = prefill_tail, decode_matmul
        self.direct_decode = direct_decode
        self.eos_ids = _eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise ValueError(
                "the tokenizer has no `eos_token_id`; generation needs one to end a turn"
            )
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        )
        self.vocab_limit = len(tokenizer)
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.windows = attention_windows(model.config)
        self._cache: dict[int, EpisodeKV] = {}
        # Cumulative counters; tests use them to check that turn t re-encodes nothing old.
        self.stats = {
            "prefill_tokens": 0,
            "reused_tokens": 0,
            "generated_tokens": 0,
            "forwards": 0,
            "shared_prompt_tokens": 0,
            "whole_buffer_calls": 0,
            "direct_decode_steps": 0,
        }

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def release(self, keys: list[int] | None = None) -> None:
        """Drop cached KV for ``keys`` (all when None). Call it whenever the weights change."""
        if keys is None:
            self._cache.clear()
        else:
            for k in keys:
                self._cache.pop(k, None)

    def prepare(self, layout: Any, model: Any) -> float:
        """Bind the stage's model (the placement for ``layout``); KV cached under another model is
        dropped. Nothing to switch: returns 0.0."""
        if model is not self.model:
            self.model, self._tensor_parallel = model, has_dtensor(model)
            self._cache.clear()
        return 0.0

    def after_update(self, model: Any) -> None:
        """The weights changed: every cached KV was computed by the old ones."""
        self._cache.clear()

    def metrics(self) -> dict[str, float]:
        return {}

    def cached_keys(self) -> list[int]:
        return sorted(self._cache)

    def generate(self, requests: list[GenRequest], sampling: SamplingConfig) -> list[GenOutput]:
        """One assistant turn for every request, batched; outputs in request order."""
        check_requests(requests)
        if not requests:
            return []
        try:
            with (
                eval_mode(self.model),
                gqa_attention(self.model, self.gqa_decode_rows, self.decode_matmul),
                torch.inference_mode(),
            ):
                return self._generate(requests, sampling)
        finally:
            if self._tensor_parallel:
                # DTensor's sharding propagation, on a shape it has not cached (every new prefill
                # width), raises and catches an exception whose traceback holds the forward's
                # frames: the call's mask and activations would live until the cycle collector
                # next runs, after the next call has allocated its own. A young-generation pass
                # (~1 ms) frees them now.
                gc.collect(1)

    # ---- one call ------------------------------------------------------------------------
    def _generate(self, requests: list[GenRequest], sampling: SamplingConfig) -> list[GenOutput]:
        entries = [self._reusable(r) for r in requests]
        # all continue rows of one buffer
        whole = common_resident(entries) if self.reuse_buffer else None
        if whole is None and self.share_prompts:
            entries = self._shared_prompts(requests, entries)
        prefix_valid = None if whole is None else whole[2]
        self.stats["whole_buffer_calls"] += whole is not None
        batch = self._layout(requests, entries, sampling.max_new_tokens, prefix_valid)
        cache = build_cache(self.num_layers, batch.capacity, batch.prefix_cols, entries, whole)
        logits = self._prefill(batch, cache)
        # The prefixes are in the new buffer now: let the previous one go unless an episode absent
        # from this call still points at it.
        entries = whole = prefix_valid = None
        seeds = (
            None
            if sampling.seed is None
            else [row_seed(sampling.seed, r.key, len(r.prompt_ids)) for r in requests]
        )
        uniforms = draw_uniforms(seeds, len(requests), sampling.max_new_tokens, self.device)
        tokens, logps, lengths, stopped = self._decode(batch, cache, logits, sampling, uniforms)
        if self.reuse_kv:
            self._store(requests, tokens, lengths, batch, cache)
        self.stats["generated_tokens"] += sum(lengths)
        return [
            GenOutput(
                tokens[i][: lengths[i]],
                [0.0] * lengths[i] if sampling.greedy else logps[i][: lengths[i]],
                "stop" if stopped[i] else "length",
            )
            for i in range(len(requests))
        ]

    def _reusable(self, req: GenRequest) -> EpisodeKV | None:
        """The cached entry for this key if its ids are a strict prefix of the new prompt."""
        entry = self._cache.pop(req.key, None) if self.reuse_kv else None
        if entry is None or len(entry.ids) >= len(req.prompt_ids):
            return None
        if req.prompt_ids[: len(entry.ids)] != entry.ids:
            return None  # the context was rewritten: recompute from scratch
        return entry

    def _shared_prompts(
        self, requests: list[GenRequest], entries: list[EpisodeKV | None]
    ) -> list[EpisodeKV | None]:
        """Entries for uncached requests whose prompt another uncached request of the call shares:
        the prompt but its last token, encoded once per distinct prompt. The layers' tensors are
        shared read-only; the packed buffer copies them in."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (req, entry) in enumerate(zip(requests, entries)):
            if entry is None and len(req.prompt_ids) > 1:
                groups.setdefault(tuple(req.prompt_ids), []).append(i)
        shared = [ids for ids, rows in groups.items() if len(rows) > 1]
        if not shared:
            return entries
        heads = [GenRequest(-1 - j, list(ids[:-1])) for j, ids in enumerate(shared)]
        batch = self._layout(heads, [None] * len(heads), max_new=1)
        cache = build_cache(self.num_layers, batch.capacity, batch.prefix_cols, [None] * len(heads))
        self._prefill(batch, cache)
        out = list(entries)
        for j, ids in enumerate(shared):
            cols = batch.valid[j].nonzero().flatten()
            entry = EpisodeKV(
                list(ids[:-1]), layers=[layer.extract(j, cols) for layer in cache.layers]
            )
            for i in groups[ids]:
                out[i] = entry
            self.stats["shared_prompt_tokens"] += (len(groups[ids]) - 1) * len(heads[j].prompt_ids)
        return out

    def _layout(
        self,
        requests: list[GenRequest],
        entries: list[EpisodeKV | None],
        max_new: int,
        prefix_valid: torch.Tensor | None = None,
    ) -> _Batch:
        """The call's columns; ``prefix_valid`` [B, P]: the prefix is a resident buffer's first P
        columns as they are (holes included), else each row's cache left-padded to the longest."""
        cached = [len(e.ids) if e is not None else 0 for e in entries]
        suffixes = [r.prompt_ids[c:] for r, c in zip(requests, cached)]
        lens = [len(s) for s in suffixes]
        prefix_cols = max(cached) if prefix_valid is None else prefix_valid.shape[1]
        width = max(lens)
        decode_start = prefix_cols + width
        capacity = decode_start + max_new - 1
        b = len(requests)
        # every row's suffix right-aligned at decode_start, its prefix right-aligned at prefix_cols
        n_t, c_t = torch.tensor(lens), torch.tensor(cached)
        rows = torch.repeat_interleave(torch.arange(b), n_t)
        within = torch.arange(rows.numel()) - torch.repeat_interleave(n_t.cumsum(0) - n_t, n_t)
        at = (width - n_t)[rows] + within
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        ids[rows, at] = torch.tensor([t for s in suffixes for t in s], dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        pos[rows, at] = c_t[rows] + within
        valid = torch.zeros(b, capacity, dtype=torch.bool)
        valid[:, prefix_cols:decode_start] = torch.arange(width) >= (width - n_t)[:, None]
        if prefix_valid is None:
            valid[:, :prefix_cols] = torch.arange(prefix_cols) >= (prefix_cols - c_t)[:, None]
        self.stats["prefill_tokens"] += sum(lens)
        self.stats["reused_tokens"] += sum(cached)
        dev = self.device
        next_pos = torch.tensor([len(r.prompt_ids) for r in requests], dtype=torch.long)
        valid = valid.to(dev)
        if prefix_valid is not None:
            valid[:, :prefix_cols] = prefix_valid
        return _Batch(
            prefix_cols, decode_start, capacity, valid, ids.to(dev), pos.to(dev), next_pos.to(dev)
        )

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        self.stats["forwards"] += 1
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _prefill(self, batch: _Batch, cache: Any) -> torch.Tensor:
        """Encode the new suffixes in query chunks; returns the last column's logits [B, V]."""
        b, width = batch.suffix_ids.shape
        chunk = max(1, self.prefill_chunk_elems // (b * batch.decode_start))
        dtype = _float_dtype(self.model)
        logits = None
        with last_column_only(self.model, self.prefill_tail):
            for q0 in range(0, width, chunk):
                q1 = min(width, q0 + chunk)
                cols = torch.arange(
                    batch.prefix_cols + q0, batch.prefix_cols + q1, device=batch.valid.device
                )
                mask = attention_masks(
                    batch.valid[:, : batch.prefix_cols + q1], cols, dtype, self.windows
                )
                logits = self._forward(
                    batch.suffix_ids[:, q0:q1], batch.suffix_pos[:, q0:q1], mask, cache
                )
        return logits

    def _decode(
        self,
        batch: _Batch,
        cache: Any,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        uniforms: torch.Tensor,
    ) -> tuple[list[list[int]], list[list[float]], list[int], list[bool]]:
        """Sample up to ``max_new_tokens`` per row, feeding each sampled token back batched."""
        b, steps, dev = logits.shape[0], sampling.max_new_tokens, logits.device
        tokens = torch.full((b, steps), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros(b, steps, dtype=torch.float32, device=dev)
        active = torch.ones(b, dtype=torch.bool, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        eos = torch.tensor(sorted(self.eos_ids), device=dev)
        step_mask = step_masks(batch.valid, self.windows, _float_dtype(self.model))
        feed = self._feeder(batch, cache, steps)
        for j in range(steps):
            tok, lp = sample_tokens(
                logits,
                uniforms[:, j],
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                greedy=sampling.greedy,
                vocab_limit=self.vocab_limit,
                allowed=sampling.allowed_token_ids,
            )
            tokens[:, j] = torch.where(active, tok, self.pad_id)
            logps[:, j] = torch.where(active, lp, 0.0)
            lengths += active.long()
            hit = active & torch.isin(tok, eos)
            if sampling.stop:
                hit |= stop_hits(self.tokenizer, tokens[:, : j + 1], active & ~hit, sampling.stop)
            stopped |= hit
            active &= ~hit
            if j == steps - 1 or not bool(active.any()):
                break
            col = batch.decode_start + j
            batch.valid[:, col] = active  # a finished row's last token is never attended to
            mask = step_mask(col)
            logits = feed(tokens[:, j : j + 1], (batch.next_pos + j).unsqueeze(1), mask)
        return tokens.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()

    def _feeder(self, batch: _Batch, cache: Any, steps: int):
        """``feed(ids, positions, mask)``: the logits of a decode step, through
        :func:`decode_logits` with the call's rotary table where it applies, else the model's
        forward."""
        if not (self.direct_decode and can_decode_direct(self.model)):
            return lambda ids, pos, mask: self._forward(ids, pos, mask, cache)
        first, end = int(batch.next_pos.min()), int(batch.next_pos.max()) + steps
        like = batch.valid.new_empty(0, dtype=_float_dtype(self.model))
        rotary = rotary_table(self.model, first, end, like) if steps > 1 else None
        parts = decode_parts(self.model)

        def feed(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            self.stats["forwards"] += 1
            self.stats["direct_decode_steps"] += 1
            return decode_logits(self.model, ids, pos, mask, cache, rotary, parts)

        return feed

    def _store(
        self,
        requests: list[GenRequest],
        tokens: list[list[int]],
        lengths: list[int],
        batch: _Batch,
        cache: Any,
    ) -> None:
        """Keep the call's buffer, each request's episode pointing at its row: the fed columns are
        the prompt plus all generated tokens but the last (the last one was sampled, never fed;
        the next turn's prefill starts with it)."""
        resident = ResidentKV([(layer.keys, layer.values) for layer in cache.layers], batch.valid)
        counts = batch.valid.sum(1).tolist()
        for i, req in enumerate(requests):
            ids = req.prompt_ids + tokens[i][: lengths[i] - 1]
            if counts[i] != len(ids):  # cannot happen unless the layout logic is broken
                raise RuntimeError(
                    f"KV cache of key {req.key}: {counts[i]} columns for {len(ids)} ids"
                )
            self._cache[req.key] = EpisodeKV(ids, resident=resident, row=i)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids = set()
    for src in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(src, int):
            ids.add(src)
        elif src is not None:
            ids.update(int(x) for x in src)
    return ids


def _float_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype

"""How many bytes one rank needs for one RL stage under one layout.

Every figure is a peak per rank, built from the model's sizes, the layout and the step's
statistics (``stats``: ``num_seqs``, ``context_mean``, ``context_max``, ``context_p95``,
``gen_len``; the context lengths are the sequences as the stage sees them: the prompt so far in
rollout, the whole sequence in experience and train). Optional, for the HF rollout:
``prompt_max``, the longest first prompt, and ``turn_prefill_max``, the most new tokens a later turn
encodes over the KV cache kept between turns (0: one call per sequence); without them every call
may encode its whole context over a previous call's buffer (the safe bound).

The per-token coefficients below were measured on the project's own code paths (the padded
micro-batch forward of ``train/forward.py`` and the HF generation backend) with
``torch.autograd.graph.saved_tensors_hooks`` and peak RSS; ``tests/unit/test_memory_model_measured.py``
checks the resulting estimates against measured peaks; the per-layer ones are the model's own
(:class:`~earl_lightning.parallel.model_sizes.ModelSizes`). Pure arithmetic: no torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.parallel.layout import Layout, check_stage
from earl_lightning.parallel.model_sizes import ModelSizes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # state tensors per parameter
STATS_KEYS = ("num_seqs", "context_mean", "context_max", "context_p95", "gen_len")
OPTIONAL_STATS_KEYS = ("prompt_max", "turn_prefill_max", "scored_max", "scored_share_max")
RolloutBackend = Literal["hf", "vllm"]

# Framework memory of a stage beyond its tensors (allocator slack, autograd bookkeeping). On CPU,
# after warm-up, a 1 x 8-token tiny-model train step raises peak RSS by 5-6 MiB, which is about
# its own weights, gradients and Adam states (6 MiB), so the framework adds little; 4 MiB is kept
# as slack. A cold process also faults in code pages (about 17 MiB on its first step). On GPU
# pass the CUDA figure (cuBLAS workspace, NCCL buffers) as ``overhead_bytes``.
DEFAULT_OVERHEAD_BYTES = 4 << 20
# Logits held per token, in fp32 vocab rows: train keeps the logits, the exp() of logsumexp's
# backward and the logits' gradient (measured 2.8); experience keeps only the logits.
TRAIN_LOGIT_ROWS = 3
DEFAULT_PREFILL_CHUNK_ELEMS = 1 << 24  # the HF backend's bound on batch x query x key per prefill


def check_stats(stats: Mapping[str, Any], arg: str = "stats") -> dict[str, float]:
    """Validate the step statistics a stage reports; returns them as plain numbers."""
    if not isinstance(stats, Mapping):
        raise ValueError(
            f"`{arg}` must be a mapping with keys {list(STATS_KEYS)}, got {type(stats).__name__}"
        )
    missing = [k for k in STATS_KEYS if k not in stats]
    if missing:
        raise ValueError(f"`{arg}` lacks {missing}; required keys: {list(STATS_KEYS)}")
    out = {}
    for k in (*STATS_KEYS, *(k for k in OPTIONAL_STATS_KEYS if k in stats)):
        lo = 0 if k in ("gen_len", "turn_prefill_max", "scored_max", "scored_share_max") else 1
        out[k] = check_number(f"{arg}['{k}']", stats[k], low=lo)
    if out["context_mean"] > out["context_max"] or out["context_p95"] > out["context_max"]:
        raise ValueError(
            f"`{arg}`: context_mean ({out['context_mean']:g}) and context_p95 ({out['context_p95']:g}) "
            f"must not exceed context_max ({out['context_max']:g})"
        )
    if out.get("scored_share_max", 0) > 1:
        raise ValueError(
            f"`{arg}['scored_share_max']` must be a share in [0, 1] (the most a sequence's scored "
            f"positions make of its length), got {out['scored_share_max']:g}"
        )
    for k in OPTIONAL_STATS_KEYS:
        if out.get(k, 0) > out["context_max"]:
            raise ValueError(
                f"`{arg}['{k}']` ({out[k]:g}) must not exceed context_max "
                f"({out['context_max']:g}): a call encodes at most the whole context"
            )
    return out


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per rank. ``total`` is the stage's peak, not the sum of the parts: phases
    that never overlap (a forward's activations vs the gradients that replace them during
    backward) count as the larger of the two."""

    stage: str
    layout: str
    weights: int
    grads: int
    optimizer: int
    activations: int  # under the layout's activation-checkpointing setting
    activations_no_ckpt: int
    activations_ckpt: int
    logits: int
    kv_cache: int
    transient: int  # FSDP all-gather buffers, attention masks, prefill working set
    overhead: int
    resident: int  # the training copy kept on the device during the other stages
    total: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [
            f"{f.name}={_gib(getattr(self, f.name))}"
            for f in fields(self)
            if f.name not in ("stage", "layout", "total") and getattr(self, f.name)
        ]
        return f"{self.stage}/{self.layout}: total {_gib(self.total)} ({', '.join(parts)})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}GiB" if n >= 2**30 else f"{n / 2**20:.1f}MiB"


@dataclass(frozen=True)
class Workload:
    """What an RL run declares for sizing its stages: the rollout engine, the longest context,
    tokens generated per turn, the micro-batch budget, whether a frozen reference model runs in
    the experience stage, and whether the HF backend keeps each episode's KV cache between turns.

    No field has a default: a run's workload is made from its configuration groups in one place
    (``earl_lightning.modules.views.workload_view``), so no default here can drift from theirs.
    """

    backend: RolloutBackend  # the engine whose memory the rollout is sized as (memory_backend)
    max_context_tokens: int
    max_new_tokens: int
    micro_batch_tokens: int
    reference_model: bool
    reuse_kv: bool
    # the policy forwards run the last layer at scored positions only
    scored_last_layer: bool


def memory_backend(name: str) -> RolloutBackend:
    """The engine a generation backend's rollout memory is sized as: ``hf`` and ``vllm`` as
    themselves; a user's registered backend, whose memory this model cannot know, as ``hf``
    (a padded KV buffer per call, the larger KV of the two)."""
    return "vllm" if name == "vllm" else "hf"


class MemoryModel:
    """Estimates the peak bytes per rank of a stage under a layout.

    Args:
        model_config: a transformers config or a :class:`ModelSizes`.
        dtype: parameter / activation dtype ("float32", "bfloat16", "float16").
        optimizer: "adamw" / "adam" (two fp32-or-param-dtype states per parameter) or "sgd".
        rollout_backend: "hf" (a padded KV buffer per call; the previous call's buffer, which the
            episodes' caches point into, lives until the next call's prefill ends; chunked prefill
            with an explicit mask) or "vllm" (paged KV: only real tokens, prefill bounded by the
            layout's ``micro_batch_tokens``).
        reuse_kv: the HF backend keeps each episode's KV cache between turns (false: every call
            encodes its whole context into an empty buffer).
        reference_model: a frozen reference policy lives next to the policy in the experience stage.
        scored_share_limit: the train and experience forwards run the last decoder layer and the
            LM head only at the positions that score an action token (``train/scored.py``) in a
            micro-batch where those are at most this share of its positions (the forward's
            ``MAX_SCORED_SHARE``), as the step's stats ``scored_max`` and ``scored_share_max``
            tell; None: the plain forward everywhere.
        resident_train_state: the sharded weights and optimizer state of the train layout stay on
            the device during rollout and experience (no offload).
        overhead_bytes: fixed framework memory per rank.
        prefill_chunk_elems: the HF backend's prefill bound (batch x query x key elements).
        prefill_tail: the HF backend runs a prefill's last layer past its keys and values at the
            last column only (``HFBackend(prefill_tail=True)``, its default).
    """

    def __init__(
        self,
        model_config: Any,
        dtype: str = "float32",
        optimizer: Literal["adamw", "adam", "sgd"] = "adamw",
        *,
        rollout_backend: RolloutBackend = "hf",
        reference_model: bool = False,
        reuse_kv: bool = True,
        scored_share_limit: float | None = None,
        resident_train_state: bool = False,
        overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
        prefill_chunk_elems: int = DEFAULT_PREFILL_CHUNK_ELEMS,
        prefill_tail: bool = True,
    ) -> None:
        self.sizes = ModelSizes.from_config(model_config)
        dtype = str(dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"`dtype` must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"`optimizer` must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
            )
        check_choice("rollout_backend", rollout_backend, ("hf", "vllm"))
        check_count("overhead_bytes", overhead_bytes, 0)
        check_count("prefill_chunk_elems", prefill_chunk_elems)
        self.dtype, self.optimizer, self.rollout_backend = dtype, optimizer, rollout_backend
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.reference_model, self.resident_train_state = (
            bool(reference_model),
            bool(resident_train_state),
        )
        self.reuse_kv, self.prefill_tail = bool(reuse_kv), bool(prefill_tail)
        self.scored_share_limit = check_number(
            "scored_share_limit", scored_share_limit, low=0, high=1, strict=True, optional=True
        )
        self.overhead_bytes, self.prefill_chunk_elems = overhead_bytes, prefill_chunk_elems

    # ---- public -------------------------------------------------------------------------
    def estimate(
        self,
        stage: str,
        layout: Layout,
        stats: Mapping[str, Any],
        *,
        train_layout: Layout | None = None,
    ) -> MemoryEstimate:
        """Peak bytes per rank of ``stage`` under ``layout`` for a step with ``stats``.

        ``train_layout`` is where the training copy lives (default: ``layout``); it only matters
        with ``resident_train_state``, for rollout and experience.
        """
        check_stage(stage)
        if not isinstance(layout, Layout):
            raise ValueError(f"`layout` must be a Layout, got {type(layout).__name__}")
        s = check_stats(stats)
        if stage == "train":
            return self._train(layout, s)
        resident = self._resident(train_layout or layout)
        return (self._rollout if stage == "rollout" else self._experience)(layout, s, resident)

    def micro_batches(self, layout: Layout, stats: Mapping[str, Any]) -> tuple[int, int]:
        """(padded tokens of the largest micro-batch, an upper bound on the number of
        micro-batches) on one rank; the count only decides whether gradients accumulate.

        Follows the module's micro-batching: sequences padded to the longest of their micro-batch,
        as many as fit ``micro_batch_tokens``, a longer sequence alone. Only the longest length is
        known here, so the tokens are a bound the real largest micro-batch never exceeds.
        """
        s = check_stats(stats)
        seqs = math.ceil(s["num_seqs"] / layout.dp)
        width = math.ceil(s["context_max"])
        budget = layout.sizing_tokens
        tokens = min(seqs * width, max(width, budget))
        per_mb = max(1, budget // width)
        return tokens, math.ceil(seqs / per_mb)

    # ---- stages -------------------------------------------------------------------------
    def _train(self, layout: Layout, s: dict[str, float]) -> MemoryEstimate:
        z, b, shards = self.sizes, self.dtype_bytes, layout.dp * layout.tp
        weights = z.num_params * b // shards  # FSDP over dp, TP over tp
        grads = weights
        optimizer = OPTIMIZER_STATES[self.optimizer] * weights
        tokens, n_mb = self.micro_batches(layout, s)
        scored = None if layout.activation_checkpointing else self._scored_positions(s, tokens)
        full = int(
            tokens * (z.num_layers * z.saved_per_token(layout.tp) + 3 * z.hidden_size + 6) * b
        )
        if scored is not None:  # the last layer keeps its normed input, keys and values everywhere;
            # its other activations, the final norm's and the head's input only at the scored positions
            last = z.hidden_size + 2 + 4 * z.kv_dim / layout.tp
            full = int(
                (
                    tokens * ((z.num_layers - 1) * z.saved_per_token(layout.tp) + last)
                    + scored * (z.saved_per_token(layout.tp) + 3 * z.hidden_size + 6)
                )
                * b
                + scored * math.ceil(s["context_max"]) * 5
            )  # its [S, 1, K, L] mask, bool and float
        ckpt = int(
            tokens
            * (
                z.num_layers * z.hidden_size
                + 3 * z.hidden_size
                + 6
                + z.recompute_per_token(layout.tp)
            )
            * b
        )
        mask = self._mask_bytes(layout, s)  # built once per forward, saved by SDPA for backward
        full, ckpt = full + mask, ckpt + mask
        acts = ckpt if layout.activation_checkpointing else full
        logits = (scored or tokens) * z.vocab_size * (4 * TRAIN_LOGIT_ROWS + (b if b != 4 else 0))
        # FSDP keeps the unit being computed and the prefetched one gathered, plus the unit's
        # unsharded gradient before its reduce-scatter.
        unit = max(z.layer_params, z.embedding_params) * b // layout.tp
        transient = 3 * unit if layout.dp > 1 else 0
        static = weights + optimizer + transient + self.overhead_bytes
        # One micro-batch: its activations are freed as the gradients appear (peak = the larger).
        # Several: the gradients of the first ones are alive during the next forward.
        total = static + (grads + acts + logits if n_mb > 1 else max(acts + logits, grads))
        return MemoryEstimate(
            "train",
            layout.name,
            weights,
            grads,
            optimizer,
            acts,
            full,
            ckpt,
            logits,
            0,
            transient,
            self.overhead_bytes,
            0,
            total,
        )

    def _rollout(self, layout: Layout, s: dict[str, float], resident: int) -> MemoryEstimate:
        z, b, tp = self.sizes, self.dtype_bytes, layout.tp
        weights = z.num_params * b // tp
        seqs = math.ceil(s["num_seqs"] / layout.dp)
        kv_tok = z.kv_bytes_per_token(tp, b)
        # last-position logits, probabilities, sampling scratch
        logits = seqs * z.vocab_size * 4 * 3
        if self.rollout_backend == "hf":
            kv, transient = self._hf_calls(seqs, s, tp)
            total = weights + kv + transient + logits + self.overhead_bytes + resident
        else:
            kv = int(seqs * (s["context_mean"] + s["gen_len"]) * kv_tok)
            chunk = min(seqs * s["context_max"], layout.sizing_tokens)
            transient = int(chunk * z.inference_per_token(tp) * b)
            total = weights + kv + transient + logits + self.overhead_bytes + resident
        return MemoryEstimate(
            "rollout",
            layout.name,
            weights,
            0,
            0,
            0,
            0,
            0,
            logits,
            kv,
            transient,
            self.overhead_bytes,
            resident,
            int(total),
        )

    def _hf_calls(self, seqs: int, s: dict[str, float], tp: int) -> tuple[int, int]:
        """(KV, prefill working set) of the HF backend's dearest call. The first call encodes the
        prompts into an empty buffer. Each later call holds the previous call's buffer (as wide as
        its longest row, which this context bounds: the episodes' caches point into it) until its
        prefill has copied their prefixes, and encodes only the turn's new tokens. The prefill
        builds a [seqs, query, key] mask, its queries bounded by ``prefill_chunk_elems``."""
        z, b, gen = self.sizes, self.dtype_bytes, s["gen_len"]
        kv_tok = z.kv_bytes_per_token(tp, b)
        ctx = math.ceil(s["context_max"])
        prompt = math.ceil(s.get("prompt_max", ctx)) if self.reuse_kv else ctx
        turn = math.ceil(s.get("turn_prefill_max", ctx)) if self.reuse_kv else 0

        def prefill(query: int, keys: int, per_token: float) -> int:
            query = max(1, min(query, self.prefill_chunk_elems // max(1, seqs * keys)))
            return int(seqs * query * (keys + per_token) * b)

        calls = [
            (
                int(seqs * (prompt + gen) * kv_tok),
                prefill(prompt, prompt, z.inference_per_token(tp)),
            )
        ]
        # The last call's buffer is the whole context (its generation included), the one before it
        # the context before the turn's new tokens and generation; where the turns' sizes are not
        # known, a call may encode its whole context next to a whole-context buffer.
        known = "turn_prefill_max" in s
        buffers = 2 * ctx - turn - gen if known else 2 * ctx + gen
        per_token = self._turn_per_token(tp) if known else z.inference_per_token(tp)
        if turn:
            calls.append((int(seqs * buffers * kv_tok), prefill(turn, ctx, per_token)))
        return max(calls, key=sum)

    def _turn_per_token(self, tp: int) -> float:
        """Elements alive per new token in a later turn's prefill (besides its mask). With the last
        layer at the last column (``prefill_tail``) this measured at most 4h + i/2 on the 6- and
        10-turn cases of ``tests/unit/test_memory_model_measured.py`` (the whole layer: 4h + 3i,
        as for a first prompt, which measured 4h + 3i either way)."""
        z = self.sizes
        if not self.prefill_tail:
            return z.inference_per_token(tp)
        return 4 * z.hidden_size + z.intermediate_size / (2 * tp)

    def _experience(self, layout: Layout, s: dict[str, float], resident: int) -> MemoryEstimate:
        z, b = self.sizes, self.dtype_bytes
        weights = z.num_params * b // layout.tp * (2 if self.reference_model else 1)
        tokens, _ = self.micro_batches(layout, s)
        acts = int(tokens * z.inference_per_token(layout.tp) * b)
        # The fp32 logits of the micro-batch, plus one sequence's logsumexp scratch (TRL's
        # selective_log_softmax goes row by row); a bf16 model also holds its own-dtype logits.
        width = math.ceil(s["context_max"])
        scored = self._scored_positions(s, tokens)
        if scored is not None:  # the logits of the scored positions only; one row's scratch of them
            width = max(1, math.ceil(s["scored_max"]))
        logits = (scored or tokens) * z.vocab_size * (
            4 + (b if b != 4 else 0)
        ) + width * z.vocab_size * 4
        mask = self._mask_bytes(layout, s)
        total = weights + max(acts, logits) + mask + self.overhead_bytes + resident
        return MemoryEstimate(
            "experience",
            layout.name,
            weights,
            0,
            0,
            acts,
            acts,
            acts,
            logits,
            0,
            mask,
            self.overhead_bytes,
            resident,
            int(total),
        )

    def _scored_positions(self, s: dict[str, float], tokens: int) -> int | None:
        """The positions the scored last layer runs at in the largest micro-batch of ``tokens``
        padded tokens, or None where the plain forward runs. A micro-batch scores at most
        ``scored_max`` positions per row and at most ``scored_share_max`` of its padded positions
        (its rows are no longer than its width), so the path is taken in every micro-batch when
        that share is within :attr:`scored_share_limit`."""
        share, most = s.get("scored_share_max"), s.get("scored_max")
        if (
            self.scored_share_limit is None
            or share is None
            or most is None
            or not 0 < share <= self.scored_share_limit
        ):
            return None
        rows = max(1, tokens // max(1, math.ceil(s["context_max"])))
        return max(1, min(math.ceil(tokens * share), rows * math.ceil(most)))

    def _mask_bytes(self, layout: Layout, s: dict[str, float]) -> int:
        """The 4-D attention mask of a padded micro-batch: HF builds [S, 1, W, W] booleans and SDPA
        works on an additive copy in the compute dtype (measured on CPU: +200 MiB for 2 x 4840
        tokens, 0 without padding). Only when lengths differ, i.e. when there is padding."""
        if s["context_max"] <= s["context_mean"]:
            return 0
        tokens, _ = self.micro_batches(layout, s)
        width = math.ceil(s["context_max"])
        seqs = tokens // width
        return seqs * width * width * (1 + self.dtype_bytes) if seqs > 1 else 0

    def _resident(self, train_layout: Layout) -> int:
        if not self.resident_train_state:
            return 0
        shard = self.sizes.num_params * self.dtype_bytes // train_layout.world_size
        return shard * (1 + OPTIMIZER_STATES[self.optimizer])

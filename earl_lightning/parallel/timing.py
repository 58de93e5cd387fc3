"""How long an RL stage takes under a layout on a device, from the model's sizes alone: a
roofline per kernel family plus collectives and per-call overheads.

- **Rollout** (the HF backend's turns): each turn prefills its new tokens (matmul FLOPs and
  attention FLOPs over the keys so far, each against the device's peak times an efficiency,
  or the bytes it must read, whichever takes longer), then decodes ``gen_len`` tokens, each a
  pass that reads the TP shard's weights and every sequence's KV cache from memory. Every
  forward pays ``2 L + 2`` all-reduces of its activations inside the TP group. Before the stage
  the rollout replica is refreshed from the train copy (its TP shard over the network).
- **Experience**: the no-grad forward of every micro-batch (the policy's, none when the update
  is exactly on-policy; the reference model's with a KL term), the log-softmax over the
  vocabulary at the scored positions, and the dispatcher's all-to-all that brings the batch.
- **Train**: forward + backward (3x the forward's FLOPs, 4x with activation checkpointing) per
  micro-batch and PPO epoch; FSDP all-gathers the weights twice and reduce-scatters the
  gradients per micro-batch over the dp group, overlapped with compute by the device's
  ``comm_overlap``; AdamW reads and writes the local shard's state per optimizer step.

Sizes, micro-batching and the scored positions come from the :class:`MemoryModel` (one source
for what a stage holds and what it computes); rates from the :class:`DeviceProfile`. Every
figure is seconds per step on the slowest rank. Pure arithmetic: no torch, no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from earl_lightning.core.checks import check_count, check_number
from earl_lightning.parallel.hardware import Cluster
from earl_lightning.parallel.layout import Layout, check_stage
from earl_lightning.parallel.memory import MemoryModel, check_stats
from earl_lightning.parallel.throughput import ProfileTable, work_tokens

# Bytes per token the dispatcher moves between stages: input ids (int64), action mask (bool),
# old log-probs, reference log-probs and advantages (fp32): benchmarks/dispatch.py's payload.
DISPATCH_BYTES_PER_TOKEN = 8 + 1 + 4 + 4 + 4
ADAM_BYTES_PER_PARAM = 7  # AdamW reads p, g, m, v and writes p, m, v: 7 passes of the dtype


class TimeModel:
    """Predicted seconds of each RL stage under a layout.

    Args:
        memory: the run's memory model (model sizes, dtype, backend, reference model, scored
            last layer, micro-batching).
        cluster: the devices and how they are connected.
        turns: generation calls per episode in a rollout (the recipe's ``max_turns``).
        ppo_epochs: passes of the train stage over the batch.
        optimizer_steps: optimizer steps per train stage (epochs x mini-batches).
        experience_forwards: the forwards of the experience stage: the policy's unless the update
            is exactly on-policy (its old log-probs are then the train forward's own), plus the
            reference model's with a KL term; default: the policy's and, when the memory model
            holds one, the reference's.
    """

    def __init__(
        self,
        memory: MemoryModel,
        cluster: Cluster,
        *,
        turns: int = 1,
        ppo_epochs: int = 1,
        optimizer_steps: int = 1,
        experience_forwards: int | None = None,
    ) -> None:
        if not isinstance(memory, MemoryModel):
            raise ValueError(f"`memory` must be a MemoryModel, got {type(memory).__name__}")
        if not isinstance(cluster, Cluster):
            raise ValueError(f"`cluster` must be a Cluster, got {type(cluster).__name__}")
        self.memory, self.cluster, self.device = memory, cluster, cluster.device
        self.turns = check_count("turns", turns)
        self.ppo_epochs = check_count("ppo_epochs", ppo_epochs)
        self.optimizer_steps = check_count("optimizer_steps", optimizer_steps)
        default = 1 + int(memory.reference_model)
        self.experience_forwards = check_count(
            "experience_forwards",
            default if experience_forwards is None else experience_forwards,
            0,
        )
        self.peak = self.device.flops(memory.dtype)

    # ---- public -----------------------------------------------------------------------------
    def seconds(
        self, stage: str, layout: Layout, stats: Mapping[str, Any], *, skip: Iterable[str] = ()
    ) -> float:
        """The stage's predicted seconds: the sum of :meth:`breakdown` less the parts in ``skip``."""
        skip = set(skip)
        return sum(v for k, v in self.breakdown(stage, layout, stats).items() if k not in skip)

    def breakdown(self, stage: str, layout: Layout, stats: Mapping[str, Any]) -> dict[str, float]:
        """Seconds per part of the stage (``compute``, ``tp_comm``, ``overhead``, ...)."""
        check_stage(stage)
        layout.check_world(self.cluster.world_size)
        s = check_stats(stats)
        return {"rollout": self._rollout, "experience": self._experience, "train": self._train}[
            stage
        ](layout, s)

    def table(
        self,
        candidates: Mapping[str, list[Layout]],
        stats: Iterable[Mapping[str, Any]],
        model_name: str = "model",
    ) -> ProfileTable:
        """A throughput table the :class:`Selector` reads like a measured profile: at each step's
        (context, sequences) every candidate's tokens/s is its work over the predicted seconds, so
        the selector's predicted stage time is this model's."""
        table = ProfileTable(model_name, self.cluster.world_size, device=self.cluster.name)
        for st in stats:
            s = check_stats(st)
            ctx, n = max(1, round(s["context_mean"])), max(1, round(s["num_seqs"]))
            for stage, layouts in candidates.items():
                work = max(work_tokens(stage, s), 1.0)
                for lay in layouts:
                    # a stage that does nothing (an on-policy experience on one rank) still ranks
                    table.add(stage, ctx, n, lay, work / max(self.seconds(stage, lay, s), 1e-9))
        return table

    def sync_seconds(self, layout: Layout) -> float:
        """Refreshing an inference replica from the train copy: every rank receives its TP shard
        of the weights from the ranks that hold the FSDP shards (all of them)."""
        z, world = self.memory.sizes, self.cluster.world_size
        bw, lat = self.cluster.link(world, world)
        if world == 1:
            return 0.0
        return lat + z.num_params * self.memory.dtype_bytes / layout.tp * (world - 1) / world / bw

    def dispatch_seconds(
        self, payload_bytes: float, ranks: int, method: str = "all_to_all"
    ) -> float:
        """Moving ``payload_bytes`` per rank to other ranks: ``all_to_all`` (each rank sends and
        receives (n-1)/n of its payload at once, one message per peer) or ``centralized`` (rank 0
        gathers every payload, then scatters it: 2 (n-1) payloads through one link in turn)."""
        check_number("payload_bytes", payload_bytes, low=0)
        check_count("ranks", ranks)
        if ranks == 1:
            return 0.0
        bw, lat = self.cluster.link(ranks, ranks)
        if method == "all_to_all":
            return (ranks - 1) * lat + payload_bytes * (ranks - 1) / ranks / bw
        if method == "centralized":
            return 2 * (ranks - 1) * lat + 2 * payload_bytes * (ranks - 1) / bw
        raise ValueError(f"`method` must be 'all_to_all' or 'centralized', got {method!r}")

    # ---- building blocks --------------------------------------------------------------------
    def _kernels(
        self, mm_flops: float, mm_bytes: float, attn_flops: float, attn_bytes: float
    ) -> float:
        """Matmuls and attention, each bound by its FLOPs or the bytes it reads."""
        d = self.device
        bw = d.memory_bandwidth * d.memory_efficiency
        mm = max(mm_flops / (self.peak * d.matmul_efficiency), mm_bytes / bw)
        return mm + max(attn_flops / (self.peak * d.attention_efficiency), attn_bytes / bw)

    def _stream(self, nbytes: float) -> float:
        d = self.device
        return nbytes / (d.memory_bandwidth * d.memory_efficiency)

    def _tp_forward(self, layout: Layout, tokens: float, head_tokens: float) -> float:
        """A forward's TP collectives: 2 all-reduces per layer and one for the embedding of the
        activations, and the LM head's all-gather of the vocabulary shards."""
        tp = layout.tp
        if tp == 1:
            return 0.0
        z, b = self.memory.sizes, self.memory.dtype_bytes
        bw, lat = self.cluster.link(tp, tp)
        reduce = (2 * z.num_layers + 1) * (
            lat + 2 * (tp - 1) / tp * tokens * z.hidden_size * b / bw
        )
        gather = lat + (tp - 1) / tp * head_tokens * z.vocab_size * 4 / bw
        return reduce + gather

    def _body_params(self) -> float:
        z = self.memory.sizes
        return z.num_layers * z.layer_params

    def _forward(self, layout: Layout, seqs: float, length: float, head_tokens: float) -> float:
        """Compute of one full forward over ``seqs`` sequences of ``length`` tokens (causal)."""
        z, b, tp = self.memory.sizes, self.memory.dtype_bytes, layout.tp
        tokens = seqs * length
        mm = 2 * tokens * self._body_params() / tp + 2 * head_tokens * z.embedding_params / tp
        weights = (self._body_params() + z.embedding_params) * b / tp
        attn = 2 * seqs * length * length * z.q_dim * z.num_layers / tp
        elementwise = tokens * z.num_layers * z.inference_per_token(tp) * b * 2
        return self._kernels(mm, weights, attn, 0.0) + self._stream(elementwise)

    def _scored(self, s: dict[str, float], tokens: float) -> float:
        """The positions whose logits a forward computes: the scored ones where the memory model
        says the scored last layer runs, else every token."""
        limit, share = self.memory.scored_share_limit, s.get("scored_share_max")
        if limit is None or share is None or not 0 < share <= limit:
            return tokens
        return tokens * share

    def _dispatch_in(self, layout: Layout, s: dict[str, float]) -> float:
        """The all-to-all that brings a stage its share of the batch (each TP member its own copy)."""
        payload = s["num_seqs"] * s["context_mean"] * DISPATCH_BYTES_PER_TOKEN / layout.dp
        return self.dispatch_seconds(payload, self.cluster.world_size)

    # ---- stages -----------------------------------------------------------------------------
    def _rollout(self, layout: Layout, s: dict[str, float]) -> dict[str, float]:
        z, b, tp, d = self.memory.sizes, self.memory.dtype_bytes, layout.tp, self.device
        seqs = math.ceil(s["num_seqs"] / layout.dp)
        gen, turns = s["gen_len"], self.turns
        kv_tok = z.kv_bytes_per_token(tp, b)
        weights = (self._body_params() + z.embedding_params) * b / tp
        per_turn = max(1.0, (s["context_max"] - (turns - 1) * gen) / turns)  # new prompt tokens
        prefill = decode = comm = overhead = 0.0
        for t in range(turns):
            before = t * (per_turn + gen)
            q, k0 = (per_turn, before) if self.memory.reuse_kv else (before + per_turn, 0.0)
            mm = 2 * seqs * q * self._body_params() / tp + 2 * seqs * z.embedding_params / tp
            attn = 4 * seqs * q * (k0 + q / 2) * z.q_dim * z.num_layers / tp
            copy = (
                2 * seqs * before * kv_tok if self.memory.reuse_kv else 0.0
            )  # HF: buffer to buffer
            act = seqs * q * z.num_layers * z.inference_per_token(tp) * b * 2
            prefill += self._kernels(mm, weights, attn, 0.0) + self._stream(
                copy + act + seqs * q * kv_tok
            )
            keys = before + per_turn + gen / 2
            step_mm = 2 * seqs * (self._body_params() + z.embedding_params) / tp
            step_attn = 4 * seqs * keys * z.q_dim * z.num_layers / tp
            decode += gen * self._kernels(step_mm, weights, step_attn, seqs * keys * kv_tok)
            chunks = math.ceil(seqs * q * (k0 + q) / self.memory.prefill_chunk_elems)
            overhead += (chunks + gen) * z.num_layers * d.layer_overhead_s + gen * d.step_overhead_s
            comm += self._tp_forward(layout, seqs * q, seqs) + gen * self._tp_forward(
                layout, seqs, seqs
            )
        return {
            "prefill": prefill,
            "decode": decode,
            "tp_comm": comm,
            "overhead": overhead,
            "sync": self.sync_seconds(layout),
        }

    def _experience(self, layout: Layout, s: dict[str, float]) -> dict[str, float]:
        z, d = self.memory.sizes, self.device
        seqs, length = math.ceil(s["num_seqs"] / layout.dp), s["context_max"]
        _, n_mb = self.memory.micro_batches(layout, s)
        models = self.experience_forwards
        head = self._scored(s, seqs * length)
        compute = models * n_mb * self._forward(layout, seqs / n_mb, length, head / n_mb)
        logsoftmax = self._stream(models * head * z.vocab_size * 4 * 3)
        return {
            "compute": compute + logsoftmax,
            "tp_comm": models * n_mb * self._tp_forward(layout, seqs * length / n_mb, head / n_mb),
            "overhead": models * n_mb * z.num_layers * d.layer_overhead_s,
            "dispatch": self._dispatch_in(layout, s),
        }

    def _train(self, layout: Layout, s: dict[str, float]) -> dict[str, float]:
        z, b, d = self.memory.sizes, self.memory.dtype_bytes, self.device
        seqs, length = math.ceil(s["num_seqs"] / layout.dp), s["context_max"]
        _, n_mb = self.memory.micro_batches(layout, s)
        passes = 4 if layout.activation_checkpointing else 3  # forward, 2x backward, recompute
        head = self._scored(s, seqs * length)
        fwd = n_mb * self._forward(layout, seqs / n_mb, length, head / n_mb)
        compute = self.ppo_epochs * (passes * fwd + self._stream(head * z.vocab_size * 4 * 3))
        shard = z.num_params * b / layout.tp
        fsdp = 0.0
        if layout.dp > 1:
            bw, lat = self.cluster.link(layout.dp, self.cluster.world_size)
            per_mb = 3 * (z.num_layers + 1) * lat + 3 * shard * (layout.dp - 1) / layout.dp / bw
            fsdp = self.ppo_epochs * n_mb * per_mb
        exposed = fsdp - d.comm_overlap * min(fsdp, compute)
        tp = (
            self.ppo_epochs
            * n_mb
            * (passes - 1)
            * self._tp_forward(layout, seqs * length / n_mb, head / n_mb)
        )
        opt = self.optimizer_steps * self._stream(ADAM_BYTES_PER_PARAM * shard / layout.dp)
        return {
            "compute": compute,
            "fsdp_comm": exposed,
            "tp_comm": tp,
            "overhead": self.ppo_epochs * n_mb * passes * z.num_layers * d.layer_overhead_s,
            "optimizer": opt,
            "dispatch": self._dispatch_in(layout, s),
        }

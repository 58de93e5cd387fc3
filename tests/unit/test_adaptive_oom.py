"""OOM recovery on one process: the real exception types raised from inside each stage's own
function (the rollout, the experience forward, the PPO update) whenever the stage runs under the
largest micro-batch. The step is not lost, the stage moves to the next feasible layout, and
``oom/recoveries`` is logged. The 2-process version is tests/distributed/test_adaptive_oom.py."""

from __future__ import annotations

import pytest
import torch

import earl_lightning.modules.rl as rl
import earl_lightning.train.forward as forward
from earl_lightning.callbacks import AdaptiveParallelism
from tests.unit.test_adaptive import datamodule, module, trainer

BAD = 1024  # the micro-batch budget that "does not fit"

CPU_OOM = RuntimeError(
    "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
)
CUDA_OOM = torch.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.15 GiB of which 1.02 GiB is free."
)
# vLLM's text (vllm/v1/core/kv_cache_utils.py), raised as the same type, ValueError
VLLM_OOM = ValueError(
    "To serve at least one request with the model's max seq len (4096), (0.50 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.10 GiB). Try increasing "
    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
)


def inject(monkeypatch, stage: str, err: BaseException) -> list[str]:
    """Make ``stage``'s own function raise ``err`` under the BAD micro-batch; returns the layouts it ran under."""
    seen: list[str] = []
    target = {
        "rollout": (rl.AgenticRLModule, "_play"),
        "experience": (forward, "fill_logprobs"),
        "train": (rl, "ppo_update"),
    }[stage]
    real = getattr(*target)

    def wrapped(*args, **kw):
        lay = STRATEGY["current"].current_layout  # the layout the stage is running under
        seen.append(f"{lay.name}-mbt{lay.micro_batch_tokens}")
        if lay.micro_batch_tokens == BAD:
            raise err
        return real(*args, **kw)

    monkeypatch.setattr(*target, wrapped)
    return seen


STRATEGY: dict = {}  # the running Trainer's strategy, set by each test


@pytest.mark.parametrize(
    "stage, err",
    [("rollout", VLLM_OOM), ("experience", CPU_OOM), ("train", CUDA_OOM)],
    ids=["rollout-vllm-kv", "experience-cpu-alloc", "train-torch-oom"],
)
def test_stage_oom_moves_to_next_layout_and_keeps_the_step(tmp_path, monkeypatch, stage, err):
    seen = inject(monkeypatch, stage, err)
    cb = AdaptiveParallelism(memory_budget_gb=1, micro_batch_tokens=[BAD, 256])
    t = trainer(tmp_path, [cb], steps=2)
    STRATEGY["current"] = t.strategy
    t.fit(module(), datamodule())
    assert t.global_step == 2  # both optimizer steps happened
    assert seen[:2] == [
        "dp1xtp1-mbt1024",
        "dp1xtp1-mbt256",
    ]  # failed, then retried under the next layout
    assert seen[2:] == ["dp1xtp1-mbt256"] * (len(seen) - 2)  # marked infeasible: never tried again
    assert len(cb.oom_events) == 1 and cb.oom_events[0]["stage"] == stage
    assert cb.oom_events[0]["error"].startswith(type(err).__name__)
    first = [h["layout"] for h in cb.history if h["stage"] == stage and h["step"] == 0]
    assert first == ["dp1xtp1-mbt1024", "dp1xtp1-mbt256"]
    assert (
        "dp1xtp1-mbt1024 (out of memory at this size before)"
        in [h for h in cb.history if h["stage"] == stage][1]["reason"]
    )
    assert t.logged_metrics["oom/recoveries"] == 1.0


def test_oom_without_another_layout_propagates(tmp_path, monkeypatch):
    inject(monkeypatch, "train", CUDA_OOM)
    cb = AdaptiveParallelism(memory_budget_gb=1, micro_batch_tokens=[BAD])
    t = trainer(tmp_path, [cb], steps=1)
    STRATEGY["current"] = t.strategy
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        t.fit(module(), datamodule())
    assert cb.oom_events[0]["left"] == []


def test_other_errors_are_not_retried(tmp_path, monkeypatch):
    inject(monkeypatch, "experience", RuntimeError("shape mismatch in the experience forward"))
    cb = AdaptiveParallelism(memory_budget_gb=1, micro_batch_tokens=[BAD, 256])
    t = trainer(tmp_path, [cb], steps=1)
    STRATEGY["current"] = t.strategy
    with pytest.raises(RuntimeError, match="shape mismatch"):
        t.fit(module(), datamodule())
    assert cb.oom_events == []

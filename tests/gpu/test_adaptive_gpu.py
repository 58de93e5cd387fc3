"""A real CUDA out-of-memory error inside the train stage (skipped without CUDA).

Under the 1024-token micro-batch the train stage asks the CUDA caching allocator for twice the
GPU's memory, so ``torch.OutOfMemoryError`` comes from the allocator itself, not from a test
double. AdaptiveParallelism marks that layout infeasible, the stage runs again under the 256-token
micro-batch, the step completes and the allocator has released the failed request.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_real_cuda_oom_in_train_stage_recovers(tmp_path, monkeypatch):
    import earl_lightning.modules.rl as rl
    from earl_lightning.callbacks import AdaptiveParallelism
    from earl_lightning.strategies import EarlStrategy
    from tests.unit.test_adaptive import datamodule, module

    real, box, errors = rl.ppo_update, {}, []

    def hungry_update(*args):
        if box["strategy"].current_layout.micro_batch_tokens == 1024:
            total = torch.cuda.get_device_properties(0).total_memory
            try:
                torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # the allocator refuses
            except torch.OutOfMemoryError as err:
                errors.append(err)
                raise
        return real(*args)

    monkeypatch.setattr(rl, "ppo_update", hungry_update)
    cb = AdaptiveParallelism(memory_budget_gb=8, micro_batch_tokens=[1024, 256])
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=EarlStrategy(process_group_backend="nccl"),
        callbacks=[cb],
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    box["strategy"] = trainer.strategy
    trainer.fit(module(), datamodule())
    assert trainer.global_step == 2
    assert len(errors) == 1 and isinstance(errors[0], torch.OutOfMemoryError)
    assert [(e["stage"], e["layout"]) for e in cb.oom_events] == [("train", "dp1xtp1-mbt1024")]
    assert [h["layout"] for h in cb.history if h["stage"] == "train"] == [
        "dp1xtp1-mbt1024",
        "dp1xtp1-mbt256",
        "dp1xtp1-mbt256",
    ]
    assert trainer.logged_metrics["oom/recoveries"] == 1.0
    assert torch.cuda.memory_allocated() < torch.cuda.get_device_properties(0).total_memory // 2

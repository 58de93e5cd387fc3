"""EarlStrategy in a real Lightning Trainer: stage switching, metrics, DCP save and resume into a
different train layout, and the user-facing errors."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from earl_lightning.models import make_tiny_model
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import parallelize_model
from earl_lightning.strategies import EarlStrategy
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed


def tiny_path() -> str:
    return str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128))


class TinyRL(L.LightningModule):
    """One stage of each kind per step; the loss is a stand-in (the invariance test checks RL math)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.automatic_optimization = False
        self.policy = AutoModelForCausalLM.from_pretrained(path)
        self.ref_policy = AutoModelForCausalLM.from_pretrained(path).requires_grad_(False)
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(batch_idx))
        with strategy.stage("rollout", {"num_seqs": 2}) as ctx:
            with torch.no_grad():
                rollout_logits = ctx.model("policy")(ids).logits
            coords, layout = strategy.layout_coords(), ctx.layout
            assert coords == ctx.layout.coords(self.global_rank)
        with strategy.stage("experience") as ctx:
            with torch.no_grad():
                ref_logits = ctx.model("ref_policy")(ids).logits
        with strategy.stage("train"):
            logits = self.policy(ids).logits
            opt = self.optimizers()
            loss = logits.float().pow(2).mean() + 0 * ref_logits.sum()
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
        self.seen.append(
            dict(
                layout=layout.name,
                coords=coords,
                train_logits=logits.detach(),
                rollout_logits=rollout_logits,
                metrics=strategy.pop_stage_metrics(),
            )
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(list(range(8)), batch_size=1)


def _trainer(strategy, root: str, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _fit_save_resume(rank: int, world: int, path: str, root: str):
    module = TinyRL(path)
    strategy = EarlStrategy(
        train_layout={"dp": 2, "tp": 1},
        layouts={"rollout": {"dp": 1, "tp": 2}, "experience": {"dp": 1, "tp": 2}},
    )
    trainer = _trainer(strategy, root, steps=2)
    trainer.fit(module)
    seen = module.seen
    ckpt = f"{root}/step2.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = _full_params(module.policy)

    # Resume the same run into another train layout (tp=2): DCP reshards on load.
    resumed = TinyRL(path)
    trainer2 = _trainer(EarlStrategy(train_layout={"dp": 1, "tp": 2}), root, steps=2)
    trainer2.fit(resumed, ckpt_path=ckpt)  # already at max_steps: restores and stops
    loaded = _full_params(resumed.policy)
    with pytest.raises(ValueError, match=r"unknown `stage` 'bogus'; valid stages"):
        with trainer2.strategy.stage("bogus"):
            pass
    return dict(
        layouts=[s["layout"] for s in seen],
        coords=[s["coords"] for s in seen],
        metrics=[s["metrics"] for s in seen],
        logits_close=all(
            torch.allclose(s["rollout_logits"], s["train_logits"], atol=1e-4) for s in seen[:1]
        ),
        resumed_equal=all(torch.equal(saved[n], loaded[n]) for n in saved),
        step=trainer2.global_step,
    )


def test_fit_switches_stages_and_resumes_into_another_layout(tmp_path):
    results = run_distributed(_fit_save_resume, 2, tiny_path(), str(tmp_path))
    for rank, r in enumerate(results):
        assert r["layouts"] == ["dp1xtp2", "dp1xtp2"]
        assert r["coords"] == [(0, rank)] * 2  # both ranks form one TP group: same episodes
        first, second = r["metrics"]
        assert first["layout/rollout/tp"] == 2.0 and first["layout/train/dp"] == 2.0
        # Step 1 syncs policy and ref into the tp=2 replicas (once for both stages); step 2 only
        # the updated policy: the frozen reference is never resharded again.
        assert first["reshard/bytes"] == 2 * second["reshard/bytes"] > 0
        assert "reshard/seconds" in second
        assert r["logits_close"]  # first step: rollout replica == train weights
        assert r["resumed_equal"] and r["step"] == 2


def _errors(rank: int, world: int, path: str):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers import AutoModelForCausalLM

    with pytest.raises(
        ValueError, match=r"`train_layout` dp1xtp1 has dp\*tp = 1, but the world size is 2"
    ):
        _trainer(EarlStrategy(train_layout={"dp": 1, "tp": 1}), "/tmp", 1).fit(TinyRL(path))
    with pytest.raises(ValueError, match=r"`layouts.rollout` dp4xtp1 has dp\*tp = 4"):
        _trainer(EarlStrategy(layouts={"rollout": {"dp": 4, "tp": 1}}), "/tmp", 1).fit(TinyRL(path))
    wrapped = FullyShardedDataParallel(
        AutoModelForCausalLM.from_pretrained(path), device_id=torch.device("cpu")
    )
    with pytest.raises(
        TypeError, match=r"`model` is wrapped in .*FullyShardedDataParallel \(FSDP1\)"
    ):
        parallelize_model(wrapped, mesh=None, layout=Layout(dp=2))
    return True


def test_errors_need_processes():
    assert all(run_distributed(_errors, 2, tiny_path()))


def test_errors_at_construction():
    with pytest.raises(ValueError, match=r"unknown `layouts` 'decode'; valid stages"):
        EarlStrategy(layouts={"decode": {"dp": 1, "tp": 1}})
    with pytest.raises(ValueError, match=r"`Layout.tp` must be a positive integer, got 0"):
        EarlStrategy(train_layout={"dp": 2, "tp": 0})
    with pytest.raises(ValueError, match=r"`train_layout` has unknown keys \['pp'\]"):
        EarlStrategy(train_layout={"dp": 2, "pp": 2})
    with pytest.raises(
        ValueError, match=r"`train_layout` dp2xtp1 and `layouts.train` dp1xtp2 disagree"
    ):
        EarlStrategy(train_layout={"dp": 2, "tp": 1}, layouts={"train": {"dp": 1, "tp": 2}})
    with pytest.raises(ValueError, match=r"`memory_budget_gb` must be a positive number"):
        EarlStrategy(memory_budget_gb=-1)
    with pytest.raises(
        ValueError, match=r"`reshard_method` must be one of \['layout_aware', 'naive'\], got 'fast'"
    ):
        EarlStrategy(reshard_method="fast")


def test_tp_must_divide_heads():
    from transformers import AutoModelForCausalLM

    odd = make_tiny_model(
        "earl-tiny",
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=3,
        num_key_value_heads=3,
    )
    model = AutoModelForCausalLM.from_pretrained(str(odd))
    with pytest.raises(
        ValueError, match=r"`layout` tp=2 does not divide the model's attention heads \(3\)"
    ):
        parallelize_model(model, mesh=None, layout=Layout(dp=1, tp=2))


def test_registered_as_earl():
    trainer = L.Trainer(strategy="earl", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, EarlStrategy)


def _single_process_fit(rank: int, world: int, path: str, root: str):
    module = TinyRL(path)
    _trainer(EarlStrategy(), root, steps=1).fit(module)
    return type(module.policy).__name__, module.seen[0]["layout"]


def test_world_size_one_keeps_plain_model(tmp_path):
    name, layout = run_distributed(_single_process_fit, 1, tiny_path(), str(tmp_path))[0]
    assert name == "Qwen2ForCausalLM" and layout == "dp1xtp1"  # not an FSDP wrapper class


class FixedSelector:
    def __init__(self, layout) -> None:
        self.layout, self.calls = layout, []

    def select(self, stage, stats, current):
        self.calls.append((stage, dict(stats or {}), current.name))
        return self.layout


def test_selector_drives_stage_layout_and_metrics():
    strategy = EarlStrategy()
    strategy._resolve_layouts(1)  # what setup_environment does once the world size is known
    selector = FixedSelector(Layout(dp=1, tp=1, micro_batch_tokens=256))
    strategy.register_selector(selector)
    with strategy.stage("rollout", {"num_seqs": 4}) as ctx:
        assert (
            strategy.current_layout.micro_batch_tokens == 256
            and ctx.layout is strategy.current_layout
        )
        assert ctx.name == "rollout" and ctx.micro_batch_tokens == 256 and ctx.budget(1024) == 256
        assert strategy.layout_coords() == (0, 0) and strategy.current_stage == "rollout"
    assert strategy.current_layout == strategy.train_layout and strategy.current_stage is None
    assert selector.calls == [("rollout", {"num_seqs": 4}, "dp1xtp1")]
    assert strategy.pop_stage_metrics() == {"layout/rollout/dp": 1.0, "layout/rollout/tp": 1.0}
    assert strategy.stage_metrics == {}


def test_selector_errors():
    strategy = EarlStrategy()
    strategy._resolve_layouts(1)
    with pytest.raises(TypeError, match=r"needs a `select\(stage, stats, current\)` method"):
        strategy.register_selector(object())
    strategy.register_selector(FixedSelector("dp1xtp1"))
    with pytest.raises(
        TypeError, match=r"returned 'dp1xtp1' for stage 'rollout'; expected a Layout"
    ):
        with strategy.stage("rollout"):
            pass
    strategy.register_selector(FixedSelector(Layout(dp=2, tp=1)))
    with pytest.raises(
        ValueError, match=r"`selected layout for stage 'experience'` dp2xtp1 has dp\*tp = 2"
    ):
        with strategy.stage("experience"):
            pass

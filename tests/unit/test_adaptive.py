"""AdaptiveParallelism in a real single-process Trainer: argument and setup errors, decisions logged
to TensorBoard (scalars and the reason as text), and a resumed run that decides what the
uninterrupted run decided (choices, OOM marks and the rollout context history round-trip)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from earl_lightning.callbacks import AdaptiveParallelism
from earl_lightning.models import make_tiny_model
from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.throughput import ProfileError, ProfileTable
from earl_lightning.strategies import EarlStrategy


def tiny_path() -> str:
    return str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128))


def module(**kw) -> AgenticRLModule:
    # on_policy_shortcut off: the experience stage runs its forward (OOM tests inject errors there)
    args = dict(
        model=tiny_path(),
        rollout=dict(max_turns=3, max_context_tokens=512, sampling=dict(max_new_tokens=1)),
        optim=dict(micro_batch_tokens=1024, on_policy_shortcut=False),
        transcripts={"every_n_steps": 0},
        seed=0,
    )
    args.update(kw)
    return AgenticRLModule(**args)


def datamodule(**kw) -> EpisodeDataModule:
    args = dict(
        env="recall",
        env_kwargs={"num_turns": 3, "padding_chars": 20},
        batch_size=4,
        group_size=2,
        eval_episodes=0,
    )
    args.update(kw)
    return EpisodeDataModule(**args)


def trainer(
    root: Path, callbacks: list, steps: int = 2, logger=False, strategy=None, **kw
) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy or EarlStrategy(),
        callbacks=callbacks,
        max_steps=steps,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(root),
        **kw,
    )


def synthetic_table(world: int = 1, model: str = "synthetic") -> ProfileTable:
    """Train: the 512-token micro-batch measured fastest (so it is chosen over 1024)."""
    t = ProfileTable(model, world)
    for ctx in (64, 512):
        for mbt, tps in ((1024, 1000.0), (512, 2000.0), (256, 500.0)):
            t.add("train", ctx, 4, Layout(dp=world, tp=1, micro_batch_tokens=mbt), tps)
    return t


# ---- argument errors --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(profile="p.json", profile_budget_s=10),
            r"give either `profile` \(a saved table\) or `profile_budget_s`",
        ),
        (
            dict(profile_budget_s=0),
            r"`profile_budget_s` must be a positive number of seconds or None, got 0",
        ),
        (dict(profile=3), r"`profile` must be a path to a profile JSON file, got 3"),
        (
            dict(memory_budget_gb=-1),
            r"`memory_budget_gb` must be a positive number of GiB per device or None, got -1",
        ),
        (dict(memory_budget_gb=1, memory_budget_bytes=10), r"give the memory budget once"),
        (
            dict(memory_budget_bytes="8G"),
            r"`memory_budget_bytes` must be a positive number of bytes per device or None, got '8G'",
        ),
        (
            dict(micro_batch_tokens=[512, 0]),
            r"`micro_batch_tokens` must be a non-empty list of positive integers, "
            r"got \[512, 0\]",
        ),
        (
            dict(candidates="all"),
            r"`candidates` must be 'auto' or a non-empty list of layouts, got 'all'",
        ),
        (dict(candidates=[{"dp": 1, "pp": 2}]), r"`candidates\[0\]` has unknown keys \['pp'\]"),
        (dict(candidates=[(1, 2)]), r"`candidates\[0\]` must be a Layout or a dict like"),
    ],
)
def test_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveParallelism(**kw)


def test_needs_earl_strategy(tmp_path):
    t = trainer(tmp_path, [AdaptiveParallelism(memory_budget_gb=1)], strategy="auto")
    with pytest.raises(
        ValueError,
        match=r"AdaptiveParallelism chooses layouts through EarlStrategy; the "
        r"Trainer's strategy is SingleDeviceStrategy. Use "
        r"`Trainer\(strategy=EarlStrategy\(\)\)`",
    ):
        t.fit(module(), datamodule())


def test_corrupt_profile_fails_at_setup(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text(
        '{"schema_version": 1, "model": "m", "world_size": 1, "entries": [{"stage": "decode"}]}'
    )
    t = trainer(tmp_path, [AdaptiveParallelism(profile=str(bad), memory_budget_gb=1)])
    with pytest.raises(
        ProfileError,
        match=rf"profile file '{bad}' is corrupt: entries\[0\]: unknown stage 'decode'",
    ):
        t.fit(module(), datamodule())


def test_profile_for_another_world_size_fails_at_setup(tmp_path):
    path = synthetic_table(world=2).save(tmp_path / "profile.json")
    t = trainer(tmp_path, [AdaptiveParallelism(profile=str(path), memory_budget_gb=1)])
    with pytest.raises(
        ProfileError, match=r"was measured for world_size=2, but this run has world_size=1"
    ):
        t.fit(module(), datamodule())


def test_budget_no_layout_fits_names_the_smallest_estimate(tmp_path):
    t = trainer(tmp_path, [AdaptiveParallelism(memory_budget_bytes=1 << 20)])
    with pytest.raises(
        ValueError,
        match=r"no candidate layout fits `budget_bytes`=1048576 .* for stage 'rollout' "
        r"with num_seqs=4.0, context_max=512.0: the smallest estimate is "
        r"dp1xtp1-mbt\d+ at [\d.]+ MiB",
    ):
        t.fit(module(), datamodule())


# ---- decisions and logging --------------------------------------------------------------------
def test_decisions_follow_the_profile_and_are_logged(tmp_path):
    path = synthetic_table().save(tmp_path / "profile.json")
    cb = AdaptiveParallelism(
        profile=str(path), memory_budget_gb=1, micro_batch_tokens=[1024, 512, 256]
    )
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer(tmp_path, [cb], steps=2, logger=logger, log_every_n_steps=1).fit(module(), datamodule())
    train = [h for h in cb.history if h["stage"] == "train"]
    assert [h["layout"] for h in train] == ["dp1xtp1-mbt512"] * 2
    assert "fastest that fits (2000 tok/s" in train[0]["reason"] and train[1]["reason"].startswith(
        "keep"
    )
    # without profile data for rollout, the largest micro-batch with the least TP
    assert {h["layout"] for h in cb.history if h["stage"] == "rollout"} == {"dp1xtp1-mbt1024"}
    acc = EventAccumulator(str(Path(logger.log_dir)), size_guidance={"tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in (
        "layout/train/tp",
        "layout/train/dp",
        "layout/train/predicted_mib",
        "layout/train/micro_batch_tokens",
        "layout/train/predicted_tokens_per_s",
        "layout/rollout/tp",
        "oom/recoveries",
    ):
        assert tag in scalars, tag
    assert [e.value for e in acc.Scalars("layout/train/micro_batch_tokens")] == [512.0, 512.0]
    texts = [t for t in acc.Tags()["tensors"] if t.startswith("layout/")]
    assert {
        "layout/rollout/text_summary",
        "layout/experience/text_summary",
        "layout/train/text_summary",
    } <= set(texts)
    first = acc.Tensors("layout/train/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "**dp1xtp1-mbt512**" in first and "fastest that fits" in first


def test_resumed_run_decides_the_same(tmp_path, monkeypatch):
    """An OOM at step 0 marks the 1024-token train micro-batch infeasible. The callback state saved
    in the step-2 checkpoint, restored into a new callback, makes the uninterrupted run's step-2
    decisions again (the recall contexts are the same each step, so the fresh run's first step
    stands for step 2).
    (Lightning's own restore of a single-process EarlStrategy checkpoint is not used: its model
    load needs DTensors, which one process does not have.)"""
    import earl_lightning.modules.rl as rl

    real = rl.ppo_update

    def ooming_update(models, optimizer, scheduler, batch, cfg, *args):
        if cfg.micro_batch_tokens == 1024:  # the stage's layout budget
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(models, optimizer, scheduler, batch, cfg, *args)

    monkeypatch.setattr(rl, "ppo_update", ooming_update)

    def run(root: Path, steps: int, state=None) -> AdaptiveParallelism:
        cb = AdaptiveParallelism(memory_budget_gb=1, micro_batch_tokens=[1024, 256])
        if state is not None:
            cb.load_state_dict(state)
        save = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, every_n_train_steps=1)
        mod = module()
        strategy = EarlStrategy(save_distributed_checkpoint=False)
        trainer(root, [cb, save], steps=steps, strategy=strategy).fit(mod, datamodule())
        return cb

    full = run(tmp_path / "full", 3)
    part = run(tmp_path / "part", 2)
    ckpt = torch.load(
        tmp_path / "part" / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False
    )
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("AdaptiveParallelism"))
    assert state == part.state_dict()
    resumed = run(tmp_path / "resumed", 1, state=state)
    assert len(full.oom_events) == len(part.oom_events) == 1 and not resumed.oom_events
    keys = ("stage", "layout", "reason", "predicted_bytes", "context_mean", "switched")
    last = [{k: h[k] for k in keys} for h in full.history if h["step"] == 2]
    assert [{k: h[k] for k in keys} for h in resumed.history] == last
    assert [h["layout"] for h in last if h["stage"] == "train"] == ["dp1xtp1-mbt256"]
    assert (
        resumed.state_dict()["selector"]["infeasible"]
        == full.state_dict()["selector"]["infeasible"]
    )


def test_rollout_is_sized_by_the_previous_steps_prompts_and_turns(tmp_path):
    """The recall game's rollout: its first step is sized at ``max_context_tokens`` with every call
    encoding its whole context; later steps by the previous step's final contexts, its longest
    first prompt and its longest turn, which the experience batch measured."""
    cb = AdaptiveParallelism(memory_budget_gb=1)
    trainer(tmp_path, [cb], steps=2).fit(module(), datamodule())
    rollouts = [h for h in cb.history if h["stage"] == "rollout"]
    assert rollouts[0]["context_mean"] == 512
    last = cb.state_dict()["last_context"]
    assert 1 <= max(last["turn_prefill_max"], last["prompt_max"]) < last["context_max"] <= 512
    assert (
        cb.complete_stats("rollout", {"num_seqs": 4})["turn_prefill_max"]
        == last["turn_prefill_max"]
    )
    assert rollouts[1]["predicted_bytes"] < rollouts[0]["predicted_bytes"]
    # a state saved before these stats existed: the safe bound, the whole context
    cb._apply_state(
        {
            "selector": cb.selector.state_dict(),
            "last_context": {"context_mean": 90.0, "context_max": 100.0, "context_p95": 100.0},
        }
    )
    old = cb.complete_stats("rollout", {"num_seqs": 4})
    assert old["prompt_max"] == old["turn_prefill_max"] == 100.0


def test_state_version_error():
    with pytest.raises(ValueError, match=r"AdaptiveParallelism state must have version 1, got 7"):
        AdaptiveParallelism().load_state_dict({"version": 7})


# ---- profiling ---------------------------------------------------------------------------------
def test_profile_lookup_uses_the_nearest_measured_micro_batch():
    t = ProfileTable("m", 1)
    t.add("train", 64, 4, Layout(micro_batch_tokens=8192), 100.0)
    t.add("train", 64, 4, Layout(micro_batch_tokens=512), 50.0)
    assert t.lookup("train", Layout(micro_batch_tokens=4096), 64, 4) == 100.0
    assert t.lookup("train", Layout(micro_batch_tokens=1024), 64, 4) == 50.0
    assert (
        t.lookup("train", Layout(micro_batch_tokens=4096, activation_checkpointing=True), 64, 4)
        is None
    )


def test_profiler_layout_errors():
    from earl_lightning.profiling.profiler import ProfileGrid, profile_stages

    with pytest.raises(
        ValueError,
        match=r"`layouts\[0\]` dp2xtp1 has dp\*tp = 2, but the world size is 1; "
        r"valid layouts: \['dp1xtp1'\]",
    ):
        profile_stages(lambda: None, None, layouts=[Layout(dp=2)])
    with pytest.raises(ValueError, match=r"`layouts` must be a non-empty list of Layout"):
        profile_stages(lambda: None, None, layouts=[])
    with pytest.raises(ValueError, match=r"unknown `stages` 'decode'; valid stages"):
        ProfileGrid(stages=["decode"])
    with pytest.raises(ValueError, match=r"`gen_len` must be a positive integer, got 0"):
        ProfileGrid(gen_len=0)


def test_profiles_at_fit_start_within_its_budget(tmp_path):
    cb = AdaptiveParallelism(
        profile_budget_s=60,
        profile_contexts=[32, 96],
        profile_out=str(tmp_path / "prof"),
        memory_budget_gb=1,
        micro_batch_tokens=[1024],
    )
    trainer(tmp_path, [cb], steps=1).fit(module(), datamodule())
    assert cb.table.stages() == ["rollout", "experience", "train"]
    assert cb.table.contexts("train") == [32, 96] and cb.table.layouts("train") == [
        "dp1xtp1-mbt1024"
    ]
    assert ProfileTable.load(tmp_path / "prof" / "profile.json") == cb.table
    assert all((tmp_path / "prof" / f"profile_{s}.png").is_file() for s in cb.table.stages())
    # every decision used the measured table
    assert all(h["predicted_tokens_per_s"] for h in cb.history)


def test_history_keeps_the_latest_decisions_only(tmp_path, monkeypatch):
    """Three decisions a step: a long run's history stays bounded, holding the latest steps'."""
    import earl_lightning.callbacks.adaptive as adaptive

    monkeypatch.setattr(adaptive, "HISTORY_DECISIONS", 9)
    cb = AdaptiveParallelism(memory_budget_gb=1)
    trainer(tmp_path, [cb], steps=8).fit(module(), datamodule())
    assert len(cb.history) == 9
    assert [h["step"] for h in cb.history] == [5, 5, 5, 6, 6, 6, 7, 7, 7]
    assert {h["stage"] for h in cb.history if h["step"] == 7} == {"rollout", "experience", "train"}

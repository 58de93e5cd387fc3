"""The declared contracts, on one process: both generation backends implement the whole protocol;
the stage context and its data-parallel stand-in; the exchanger's rollout shares; the OOM hook is
found by type."""

from __future__ import annotations

import torch

from earl_lightning.callbacks import AdaptiveParallelism, StageOOMHandler, WorkloadSource
from earl_lightning.dispatch.exchange import DispatchConfig, Exchanger
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.parallel.layout import Layout
from earl_lightning.rollout.backends.base import GenerationBackend
from earl_lightning.rollout.backends.registry import GENERATION_BACKENDS
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.stages import DataParallelStages, StageStrategy, stages_of
from earl_lightning.strategies import EarlStrategy

PROTOCOL = ("generate", "release", "prepare", "after_update", "metrics")


def test_both_backends_implement_the_whole_protocol():
    from transformers import AutoModelForCausalLM

    from earl_lightning.rollout.backends.hf import HFBackend
    from earl_lightning.rollout.backends.vllm import VLLMBackend

    for cls in (HFBackend, VLLMBackend):  # declared on the class, not patched on an instance
        assert all(callable(getattr(cls, name, None)) for name in PROTOCOL), cls.__name__
    path = make_tiny_model("earl-tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    backend = GENERATION_BACKENDS.get("hf", "backend")(
        model, load_tokenizer(str(path)), _spec(path)
    )
    assert isinstance(backend, GenerationBackend) and backend.metrics() == {}
    other = AutoModelForCausalLM.from_pretrained(path)
    backend._cache[1] = object()  # a cached episode, computed by `model`
    assert backend.prepare(Layout(), other) == 0.0 and backend.model is other and not backend._cache
    backend._cache[1] = object()
    backend.after_update(other)  # new weights: nothing cached survives
    assert not backend._cache


def _spec(path):
    from earl_lightning.modules.config import RolloutConfig
    from earl_lightning.modules.views import backend_spec

    return backend_spec(str(path), "float32", 0, RolloutConfig(), local_rank=0)


def test_data_parallel_stages_stand_in_for_a_plain_strategy():
    module = torch.nn.Module()
    module.policy = torch.nn.Linear(2, 2)
    stages = stages_of(object(), module, world_size=1)
    assert isinstance(stages, DataParallelStages)
    with stages.stage("rollout", {"num_seqs": 4}) as ctx:
        assert (
            ctx.name == "rollout"
            and ctx.layout == Layout(dp=1, tp=1)
            and ctx.model("policy") is module.policy
        )
        assert ctx.budget(8192) == 8192  # no layout budget: the module's own
        assert ctx.reduce.sum_floats([1.0, 2.0]) == [1.0, 2.0] and ctx.reduce.agree_count(3) == 3
    assert stages.pop_stage_metrics() == {}
    strategy = EarlStrategy()
    assert isinstance(strategy, StageStrategy) and stages_of(strategy, module, 1) is strategy


def test_exchanger_gives_whole_groups_and_tp_peers_the_same_share():
    specs = [EpisodeSpec("x", 0, g, g * 2 + m) for g in range(5) for m in range(2)]
    layout = Layout(dp=2, tp=2)
    shares = [Exchanger.rollout_share(specs, layout, rank) for rank in range(4)]
    assert shares[0] == shares[1] and shares[2] == shares[3]  # TP peers play the same episodes
    assert {s.group_id for s in shares[0]} == {0, 2, 4} and {s.group_id for s in shares[2]} == {
        1,
        3,
    }
    ex = Exchanger(DispatchConfig(tp_mode="direct"))
    assert ex.config.tp_mode == "direct" and ex.pop_metrics() == {}


def test_callbacks_declare_their_contracts():
    assert isinstance(AdaptiveParallelism(), StageOOMHandler)
    assert StageOOMHandler().on_stage_oom(None, None, "train", None, MemoryError()) is False

    class NoWorkload:
        tokenizer = None

    assert not isinstance(NoWorkload(), WorkloadSource)
    from earl_lightning.modules import AgenticRLModule

    module = AgenticRLModule(algorithm={"kl": {"coef": 0.1}}, optim={"micro_batch_tokens": 512})
    assert isinstance(module, WorkloadSource)
    assert module.workload.reference_model and module.workload.micro_batch_tokens == 512

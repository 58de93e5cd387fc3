"""`earl plan`'s model is the run's: the memory model and the candidates AdaptiveParallelism builds
in a real `fit` are the ones the plan reads from a config and a recipe; and its inputs' errors."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import yaml

from earl_lightning.callbacks import AdaptiveParallelism
from earl_lightning.models import make_tiny_model
from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.parallel.layout import STAGES, Layout
from earl_lightning.parallel.throughput import layout_key
from earl_lightning.planning.command import plan_parser, settings_from
from earl_lightning.planning.inputs import parse_contexts, read_model_config
from earl_lightning.planning.plan import make_plan, models_for, step_stats
from earl_lightning.strategies import EarlStrategy

ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path) -> Path:
    """A small recall recipe on a tiny model: a real fit of it takes seconds."""
    cfg = {
        "model": {
            "model": str(make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)),
            "rollout": {
                "max_turns": 3,
                "max_context_tokens": 512,
                "sampling": {"max_new_tokens": 2},
            },
            "optim": {"micro_batch_tokens": 1024},
            "transcript_every_n_steps": 0,
            "seed": 0,
        },
        "data": {
            "env": "recall",
            "env_kwargs": {"num_turns": 3, "padding_chars": 20},
            "batch_size": 4,
            "group_size": 2,
            "eval_episodes": 0,
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_plans_memory_and_candidates_are_the_fits(tmp_path):
    """One source: a real one-step fit under AdaptiveParallelism builds its memory model and
    candidates from the module and the Trainer; the plan builds its own from the config file and
    the recipe. Every figure the plan prints equals the fit's model's for the same layout and step."""
    path = recipe(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cb = AdaptiveParallelism(activation_checkpointing=[False, True])
    L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=EarlStrategy(),
        callbacks=[cb],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    ).fit(AgenticRLModule(**cfg["model"]), EpisodeDataModule(**cfg["data"]))
    ns = plan_parser().parse_args(
        ["--cluster", "1x1xCPU", "--recipe", str(path), "--contexts", "64,256,512"]
    )
    settings = settings_from(ns)
    result = make_plan(settings)
    fit_memory, plan_memory = cb.selector.memory_model, models_for(settings)[0]
    assert vars(plan_memory).keys() == vars(fit_memory).keys()
    for k in ("dtype", "optimizer", "rollout_backend", "reference_model", "reuse_kv"):
        assert getattr(plan_memory, k) == getattr(fit_memory, k), k
    assert plan_memory.sizes == fit_memory.sizes
    assert plan_memory.scored_share_limit == fit_memory.scored_share_limit
    rows = result.adaptive + result.static
    assert len(rows) == 3 * 3 * (1 + 2 * 3)  # contexts x stages x (adaptive + 2 ckpt x 3 mbt)
    for r in rows:
        lay = Layout(r["dp"], r["tp"], r["micro_batch_tokens"], r["activation_checkpointing"])
        s = step_stats(settings, r["context"])
        assert r["peak_bytes"] == fit_memory.estimate(r["stage"], lay, s).total, r
    plan_selector_keys = {
        st: sorted(
            {
                layout_key(
                    Layout(r["dp"], r["tp"], r["micro_batch_tokens"], r["activation_checkpointing"])
                )
                for r in result.static
                if r["stage"] == st
            }
        )
        for st in STAGES
    }
    fit_keys = {st: sorted(layout_key(c) for c in cb.selector.candidates(st)) for st in STAGES}
    assert plan_selector_keys["train"] == fit_keys["train"]
    assert set(plan_selector_keys["rollout"]) == set(fit_keys["rollout"])


def test_contexts_are_a_doubling_range_or_an_increasing_list():
    assert parse_contexts("1024:32768") == [1024, 2048, 4096, 8192, 16384, 32768]
    assert parse_contexts("1000:5000") == [1000, 2000, 4000, 5000]
    assert parse_contexts("512,4096,32768") == [512, 4096, 32768]
    for bad in ("32768:1024", "1k:4k", "1024:2048:4096", "4096,1024", "1,8", ""):
        with pytest.raises(
            ValueError, match=r"^`--contexts` must be A:B \(doubling from A up to B\)"
        ):
            parse_contexts(bad)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            {"hidden_size": 64},
            r"has no `model_type`; a transformers config.json names its architecture",
        ),
        (
            {"model_type": "qwen2", "hidden_size": 64, "vocab_size": 100},
            r"lacks \['num_hidden_layers', 'num_attention_heads', 'intermediate_size'\]",
        ),
        ({"model_type": "no-such-arch", "hidden_size": 64}, r"transformers cannot read"),
        ("{not json", r"is not readable JSON"),
    ],
)
def test_a_config_that_cannot_size_the_model_is_one_line(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message) as err:
        read_model_config(str(path), "--model")
    assert str(err.value).startswith(f"`--model` {str(path)!r}: ") and "\n" not in str(err.value)


def test_configs_by_path_directory_and_preset_and_a_missing_one(tmp_path):
    q72 = ROOT / "benchmarks" / "configs" / "qwen2.5-72b-instruct.json"
    assert read_model_config(str(q72)).num_hidden_layers == 80
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(q72.read_text())
    assert read_model_config(str(tmp_path / "m")).hidden_size == 8192
    assert read_model_config("earl-tiny").hidden_size == 128
    with pytest.raises(ValueError, match=r"`--model` './nope.json': no such config file"):
        read_model_config("./nope.json", "--model")
    with pytest.raises(ValueError, match=r"no config of that hub id is cached here"):
        read_model_config("no-such-org/no-such-model", "--model")

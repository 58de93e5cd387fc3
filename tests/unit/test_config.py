"""The module's typed configuration: nested groups from Python dicts, YAML and nested command-line
flags; every group validates itself with errors spelled the way the setting is written; registered
and import-path estimators and losses bind their parameters at configuration time."""

from __future__ import annotations

import pytest
import yaml

from earl_lightning.cli import main
from earl_lightning.core.config_groups import coerce
from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.config import (
    AdvantageConfig,
    AlgorithmConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    SamplingOptions,
)

RECIPE = "recipes/connect4_grpo.yaml"


def test_groups_from_dicts_equal_groups_from_objects():
    a = AgenticRLModule(
        rollout={"max_turns": 5, "sampling": {"max_new_tokens": 2}},
        algorithm={"advantage": {"name": "gae", "lam": 0.9}, "loss": {"clip_high": 0.3}},
        optim={"lr": 5e-4},
    )
    b = AgenticRLModule(
        rollout=RolloutConfig(max_turns=5, sampling=SamplingOptions(max_new_tokens=2)),
        algorithm=AlgorithmConfig(
            advantage=AdvantageConfig(name="gae", lam=0.9), loss=LossConfig(clip_high=0.3)
        ),
        optim=OptimConfig(lr=5e-4),
    )
    assert a.rollout_config == b.rollout_config and a.algorithm_config == b.algorithm_config
    assert a.optim_config == b.optim_config and dict(a.hparams) == dict(b.hparams)
    assert a.algorithm_config.needs_values and a.algorithm_config.advantage.params == {"lam": 0.9}
    assert a.algorithm_config.loss.params == {
        "clip_high": 0.3
    }  # unset (None) fields: the loss's own defaults
    assert isinstance(a.hparams["rollout"], dict)  # plain data in checkpoints and TensorBoard


def test_checkpoint_hparams_rebuild_the_same_module():
    a = AgenticRLModule(algorithm={"advantage": {"name": "reinforce_pp", "gamma": 0.9}})
    b = AgenticRLModule(**dict(a.hparams))
    assert b.algorithm_config == a.algorithm_config and b.rollout_config == a.rollout_config


def test_nested_flags_and_print_config(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "fit",
                "--config",
                RECIPE,
                "--model.algorithm.loss.clip_high",
                "0.31",
                "--model.optim.lr",
                "5e-4",
                "--model.rollout.sampling.temperature",
                "0.7",
                "--data.dispatch.tp_mode",
                "broadcast",
                "--print_config",
            ]
        )
    assert exc.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    model = cfg["model"]
    assert model["algorithm"]["loss"]["clip_high"] == 0.31 and model["optim"]["lr"] == 5e-4
    assert (
        model["rollout"]["sampling"]["temperature"] == 0.7
        and model["algorithm"]["advantage"]["name"] == "grpo"
    )
    assert set(model) == {
        "model",
        "dtype",
        "rollout",
        "algorithm",
        "optim",
        "seed",
        "transcripts",
        "transcript_every_n_steps",
        "logprob_mismatch_warn",
        "peft",
        "no_signal_steps",
    }
    assert cfg["data"]["dispatch"] == {
        "keep_groups": False,
        "tp_mode": "broadcast",
        "locality": True,
    }


def test_cli_reports_a_group_error_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", RECIPE, "--model.optim.ppo_epochs", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "earl: error: `--model.optim.ppo_epochs` must be a positive integer, got 0" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(rollout={"max_turns": 0}),
            r"`--model.rollout.max_turns` must be a positive integer, got 0",
        ),
        (
            dict(rollout={"backend": "trt"}),
            r"unknown `--model.rollout.backend` 'trt'; valid generation backends: \[.*'hf', 'vllm'\]",
        ),
        (
            dict(rollout={"sampling": {"temperature": 0}}),
            r"`--model.rollout.sampling.temperature` must be a positive number",
        ),
        (
            dict(rollout={"sampling": {"top_p": 1.5}}),
            r"`--model.rollout.sampling.top_p` must be a number in \(0, 1\], got 1.5",
        ),
        (
            dict(rollout={"sampling": {"stop": ")"}}),
            r"`--model.rollout.sampling.stop` must be a list of non-empty",
        ),
        (
            dict(rollout={"turns": 3}),
            r"`--model.rollout` has unknown settings \['turns'\]; valid: \['backend'",
        ),
        (
            dict(algorithm={"advantage": {"gamma": 1.5, "name": "gae"}}),
            r"`--model.algorithm.advantage.gamma` must be a number in \[0, 1\] or null, got 1.5",
        ),
        (
            dict(algorithm={"advantage": {"name": "grpo", "lam": 0.9}}),
            r"`--model.algorithm.advantage.lam` \(0.9\) does not apply to advantage estimator 'grpo'; its parameters: "
            r"\['scale', 'eps'\]",
        ),
        (
            dict(algorithm={"advantage": {"name": "rloo", "kwargs": {"temperature": 2}}}),
            r"`--model.algorithm.advantage.temperature` \(2\) does not apply to advantage estimator 'rloo'; its "
            r"parameters: \[\]",
        ),
        (
            dict(algorithm={"loss": {"name": "ppo_clip", "clip_low": 1.2}}),
            r"`--model.algorithm.loss.clip_low` must be a number in \[0, 1\) .*got 1.2",
        ),
        (
            dict(algorithm={"loss": {"dual_clip": 0.5}}),
            r"`--model.algorithm.loss.dual_clip` must be a number > 1 or null",
        ),
        (
            dict(algorithm={"loss": {"kwargs": {"beta": 1.0}}}),
            r"`--model.algorithm.loss.beta` \(1.0\) does not apply to policy loss 'ppo_clip'; its parameters: "
            r"\['clip_low', 'clip_high', 'dual_clip'\]",
        ),
        (
            dict(algorithm={"kl": {"coef": -1}}),
            r"`--model.algorithm.kl.coef` must be a number >= 0, got -1",
        ),
        (
            dict(algorithm={"value": {"clip": -0.1}}),
            r"`--model.algorithm.value.clip` must be a number >= 0 or null",
        ),
        (
            dict(algorithm={"entropy_coef": "a"}),
            r"`--model.algorithm.entropy_coef` must be a number >= 0, got 'a'",
        ),
        (dict(algorithm={"losses": {}}), r"`--model.algorithm` has unknown settings \['losses'\]"),
        (dict(optim={"lr": 0}), r"`--model.optim.lr` must be a positive number, got 0"),
        (
            dict(optim={"lr_schedule": "step"}),
            r"unknown `--model.optim.lr_schedule` 'step'; valid: \['constant', ",
        ),
        (
            dict(optim={"micro_batch_tokens": 0}),
            r"`--model.optim.micro_batch_tokens` must be a positive integer, got 0",
        ),
        (dict(dtype="fp8"), r"`--model.dtype` must be one of .*got 'fp8'"),
        (
            dict(transcripts={"every_n_steps": -1}),
            r"`--model.transcripts.every_n_steps` must be an integer >= 0, got -1",
        ),
        (
            dict(transcripts={"episodes": "last"}),
            r"`--model.transcripts.episodes` must be one of \['first', 'failed', 'best', 'worst', "
            r"'random'\], got 'last'",
        ),
        (dict(no_signal_steps=-1), r"`--model.no_signal_steps` must be an integer >= 0, got -1"),
        (
            dict(logprob_mismatch_warn=0),
            r"`--model.logprob_mismatch_warn` must be a positive number, got 0",
        ),
        (dict(optim=[1]), r"`--model.optim` must be a mapping of its settings, got \[1\]"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AgenticRLModule(**kwargs)


def test_import_path_errors_name_the_setting():
    with pytest.raises(
        ValueError,
        match=r"`--model.algorithm.loss.name` 'tests.plugins.nothing.loss': cannot "
        r"import module 'tests.plugins.nothing': ModuleNotFoundError",
    ):
        LossConfig(name="tests.plugins.nothing.loss")
    with pytest.raises(
        ValueError,
        match=r"`--model.algorithm.advantage.name` 'tests.plugins.algorithms.NOPE': "
        r"module 'tests.plugins.algorithms' has no attribute 'NOPE'",
    ):
        AdvantageConfig(name="tests.plugins.algorithms.NOPE")
    with pytest.raises(
        ValueError, match=r"`--model.algorithm.loss.name` names 3, which is not a function"
    ):
        LossConfig(name="tests.plugins.algorithms.NOT_A_FUNCTION")


def test_user_registered_loss_and_estimator_by_import_path():
    from tests.plugins import algorithms as plugins

    loss = LossConfig(
        name="tests.plugins.algorithms.centered_reinforce_loss", kwargs={"scale": 0.5}
    )
    assert loss.fn is plugins.centered_reinforce_loss and loss.params == {"scale": 0.5}
    adv = AdvantageConfig(name="tests.plugins.algorithms.whole_batch_baseline")
    assert adv.estimator.fn is plugins.whole_batch_baseline and not adv.estimator.needs_values
    # registered under a name, the same object is reachable by that name once its module is imported
    assert LossConfig(name="centered_reinforce").fn is plugins.centered_reinforce_loss


def test_coerce_keeps_instances_and_fills_defaults():
    cfg = OptimConfig(lr=0.1)
    assert coerce(OptimConfig, cfg, "--model.optim") is cfg
    assert coerce(OptimConfig, None, "--model.optim") == OptimConfig()


def test_lr_schedules():
    assert OptimConfig(warmup_steps=4).lr_factor(1, 100) == 0.5
    assert OptimConfig(lr_schedule="cosine").lr_factor(100, 100) == pytest.approx(0.0)
    assert OptimConfig(lr_schedule="linear").lr_factor(50, 100) == pytest.approx(0.5)
    assert OptimConfig().lr_factor(77, 100) == 1.0


def test_dispatch_config_errors():
    from earl_lightning.modules.datamodule import EpisodeDataModule

    assert (
        EpisodeDataModule(dispatch={"tp_mode": "broadcast"}).exchanger.config.tp_mode == "broadcast"
    )
    with pytest.raises(
        ValueError,
        match=r"`--data.dispatch.tp_mode` must be one of \['auto', 'direct', "
        r"'broadcast'\], got 'ring'",
    ):
        EpisodeDataModule(dispatch={"tp_mode": "ring"})
    with pytest.raises(
        ValueError, match=r"`--data.dispatch.locality` must be true or false, got 'yes'"
    ):
        EpisodeDataModule(dispatch={"locality": "yes"})
    with pytest.raises(ValueError, match=r"`--data.dispatch` has unknown settings \['mode'\]"):
        EpisodeDataModule(dispatch={"mode": "ring"})

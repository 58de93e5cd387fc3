"""The task settings both data modules take (``--data.env``, ``--data.dataset``, ...) are defined
once, in :class:`TaskConfig`: the same types and defaults in both signatures, the same checks and
the same one-line errors from `earl fit`'s and `earl sft`'s data modules."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import datasets
import pytest

from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.sft import DemonstrationDataModule
from earl_lightning.tasks.config import TaskConfig

MODULES = (EpisodeDataModule, DemonstrationDataModule)
EXACT = "tests.plugins.rewards.exact_sum"  # needs an `answer` column


def _rows(n: int = 4) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(n)]
    )


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_both_data_modules_take_every_task_setting_with_its_type_and_default(module):
    """The flat keywords (the recipes' ``data:`` keys) stay; their types and defaults are
    TaskConfig's, so neither module can drift from the other."""
    hints = typing.get_type_hints(module.__init__)
    params = inspect.signature(module.__init__).parameters
    own = typing.get_type_hints(TaskConfig)
    for f in dataclasses.fields(TaskConfig):
        assert hints[f.name] == own[f.name], f.name
        assert params[f.name].default == f.default, f.name


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(env="conect_four"), r"unknown `--data\.env` 'conect_four'"),
        (dict(env="openspiel", env_kwargs={"game": "checkers_xyz"}), r"checkers_xyz"),
        (dict(eval_episodes=-1), r"`--data\.eval_episodes` must be"),
        (
            dict(reward_funcs=[EXACT], reward_weights=[1.0, 2.0]),
            r"`--data\.reward_weights` has 2 weights for 1 reward functions",
        ),
        (dict(tools=["tests.plugins.no_such_module.fn"]), r"`--data\.tools\[0\]`"),
        (
            dict(env=None, dataset=_rows(), reward_funcs=[EXACT]),
            r"`--data\.reward_funcs\[0\]` .exact_sum. needs \[.answer.\]",
        ),
    ],
)
def test_a_bad_task_setting_is_the_same_one_line_error_in_both_data_modules(settings, message):
    errors = []
    for module in (TaskConfig, *MODULES):
        with pytest.raises(ValueError, match=message) as err:
            config = module(**settings)
            if module is TaskConfig:
                config.open()
        errors.append(str(err.value))
        assert "\n" not in errors[-1]
    assert len(set(errors)) == 1, errors


def test_no_environment_and_no_dataset_play_connect_four_in_both():
    assert TaskConfig().env == "connect_four"
    assert TaskConfig(dataset=_rows()).env is None
    for module in MODULES:
        dm = module()
        assert dm.env == "connect_four" and dm.hparams.env == "connect_four"


def test_evaluation_overrides_the_environment_arguments():
    task = TaskConfig(
        env="calculator",
        env_kwargs={"difficulty": "easy", "max_tool_calls": 2},
        eval_env_kwargs={"difficulty": "hard"},
    ).open()
    assert task.env_kwargs == {"difficulty": "easy", "max_tool_calls": 2}
    assert task.eval_env_kwargs == {"difficulty": "hard", "max_tool_calls": 2}


def test_the_logged_hyperparameters_name_the_environment_and_seed_played(monkeypatch):
    """What loggers show (and must agree with the module's ``seed`` when both are logged): the
    default environment by name, the run's seed for an unset one."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    for module in MODULES:
        logged = module().hparams_initial
        assert (logged.env, logged.seed) == ("connect_four", 7), module.__name__

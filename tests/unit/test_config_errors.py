"""Bad input fails at configuration time with a message naming the argument and the value."""

import pytest

from earl_lightning.cli import main
from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.datamodule import EpisodeDataModule


def test_unknown_env_name_lists_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown `--data.env` 'conect_four'.*valid environments:.*connect_four"
    ):
        EpisodeDataModule(env="conect_four")


def test_unknown_game_name():
    with pytest.raises(ValueError, match=r"game.*'checkers_xyz'"):
        EpisodeDataModule(env="openspiel", env_kwargs={"game": "checkers_xyz"})


def test_batch_size_not_multiple_of_group_size():
    with pytest.raises(
        ValueError,
        match=r"`--data.batch_size` \(10\) must be a multiple of `--data.group_size` \(4\)",
    ):
        EpisodeDataModule(batch_size=10, group_size=4)


def test_unknown_advantage_estimator():
    with pytest.raises(
        ValueError,
        match=r"unknown `--model.algorithm.advantage.name` 'gpro'; valid advantage "
        r"estimators: \[.*'gae', 'gigpo', 'grpo', 'reinforce_pp', 'rloo'.*\]",
    ):
        AgenticRLModule(algorithm={"advantage": {"name": "gpro"}})


def test_unknown_policy_loss():
    with pytest.raises(
        ValueError,
        match=r"unknown `--model.algorithm.loss.name` 'ppo'; valid policy losses: "
        r"\[.*'gspo', 'ppo_clip'.*\], or an import path",
    ):
        AgenticRLModule(algorithm={"loss": {"name": "ppo"}})


def test_unknown_loss_aggregation():
    with pytest.raises(
        ValueError, match=r"--model.algorithm.loss.aggregation.*'token_avg'.*token_mean"
    ):
        AgenticRLModule(algorithm={"loss": {"aggregation": "token_avg"}})


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match=r"--model.algorithm.kl.estimator.*'k9'.*k3"):
        AgenticRLModule(algorithm={"kl": {"estimator": "k9"}})


def test_model_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(
        FileNotFoundError, match=r"`--model.model`: model path '.*no_such_model' does not exist"
    ):
        AgenticRLModule(model=missing)


def test_a_relative_model_path_that_does_not_exist_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    # a recipe's `runs/<task>_sft/model` before that warm start was made: not a hub id
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=r"`--model.model`: model path 'runs/calculator_sft/model' does not exist",
    ):
        AgenticRLModule(model="runs/calculator_sft/model")


def test_max_context_tokens_smaller_than_first_observation():
    from earl_lightning.modules.rollout_setup import check_first_observation

    module = AgenticRLModule(rollout={"max_context_tokens": 20})
    dm = EpisodeDataModule()
    with pytest.raises(
        ValueError,
        match=r"`--model.rollout.max_context_tokens` \(20\) is smaller than the first "
        r"observation of env 'connect_four'",
    ):
        check_first_observation(module.rollout_config, module.tokenizer, dm.first_spec())


def test_cli_reports_config_errors_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "fit",
                "--config",
                "recipes/connect4_grpo.yaml",
                "--data.batch_size",
                "10",
                "--data.group_size",
                "4",
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        "earl: error: `--data.batch_size` (10) must be a multiple of `--data.group_size` (4)" in err
    )
    assert "Traceback" not in err


def test_vllm_backend_without_vllm_names_the_extra(monkeypatch):
    import earl_lightning.rollout.backends.vllm_support as vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    with pytest.raises(
        ImportError, match=r"`--model.rollout.backend vllm` needs vLLM.*earl_lightning\[vllm"
    ):
        AgenticRLModule(rollout={"backend": "vllm"})


@pytest.mark.parametrize(
    "setting, value, message",
    [
        (
            "max_tool_argument_chars",
            0,
            r"^`--model.rollout.max_tool_argument_chars` must be a positive integer or null",
        ),
        (
            "max_tool_result_chars",
            "lots",
            r"^`--model.rollout.max_tool_result_chars` must be a positive integer or null, got 'lots'",
        ),
        (
            "reward_timeout_s",
            0,
            r"^`--model.rollout.reward_timeout_s` must be a positive number or null, got 0$",
        ),
    ],
)
def test_the_limits_on_what_a_model_and_its_tools_bring_are_checked(setting, value, message):
    from earl_lightning.modules import RolloutConfig

    with pytest.raises(ValueError, match=message):
        RolloutConfig(**{setting: value})

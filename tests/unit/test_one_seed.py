"""One seed drives a run: ``seed_everything`` (``--seed_everything``, 0 unless given) is the seed
of every part whose own seed is unset (the RL module's sampling, the episode stream, the warm
start's demonstrations and evaluation); a part's seed set on purpose is kept."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from earl_lightning.cli.fit import EarlCLI
from earl_lightning.core.seeding import run_seed
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.rl import AgenticRLModule
from earl_lightning.sft.datamodule import DemonstrationDataModule
from earl_lightning.sft.module import WarmStartModule

ROOT = Path(__file__).parents[2]


def first_seeds(dm: EpisodeDataModule) -> list[int]:
    dm.setup("fit")
    return [spec.seed for spec in next(iter(dm.train_dataloader()))["specs"]]


def test_unset_seeds_follow_seed_everything():
    L.seed_everything(7)
    assert AgenticRLModule().hparams.seed == 7
    assert WarmStartModule().hparams.seed == 7
    assert DemonstrationDataModule(env="connect_four").hparams.seed == 7
    stream7 = first_seeds(EpisodeDataModule(batch_size=4, group_size=2))
    L.seed_everything(8)
    assert first_seeds(EpisodeDataModule(batch_size=4, group_size=2)) != stream7
    L.seed_everything(7)
    assert first_seeds(EpisodeDataModule(batch_size=4, group_size=2)) == stream7


def test_a_seed_set_on_purpose_is_kept():
    L.seed_everything(7)
    assert AgenticRLModule(seed=3).hparams.seed == 3
    assert EpisodeDataModule(seed=3).seed == 3


def test_without_seed_everything_the_seed_is_0():
    assert run_seed(None, "--data.seed") == 0 and EpisodeDataModule().seed == 0


def test_the_cli_seed_drives_the_module_and_the_data():
    recipe = str(ROOT / "recipes" / "connect4_grpo.yaml")
    cli = EarlCLI(
        AgenticRLModule,
        EpisodeDataModule,
        run=False,
        args=["--config", recipe, "--seed_everything", "5"],
    )
    assert cli.model.hparams.seed == 5 and cli.datamodule.seed == cli.datamodule.hparams.seed == 5
    cli = EarlCLI(
        AgenticRLModule,
        EpisodeDataModule,
        run=False,
        args=["--config", recipe, "--seed_everything", "5", "--data.seed", "2"],
    )
    assert cli.model.hparams.seed == 5 and cli.datamodule.seed == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_seed_is_one_line(bad):
    with pytest.raises(
        ValueError,
        match=r"`--data.seed` must be an integer >= 0, or null for the run's seed "
        r"\(`--seed_everything`\), got ",
    ):
        EpisodeDataModule(seed=bad)

"""A training batch (a step number and episode specs) reaches the step as it left the stream: the
DataModule's transfer hook, which Lightning selects over the module's default, moves nothing and
copies nothing."""

from __future__ import annotations

import torch
from lightning.pytorch.trainer.connectors.data_connector import _DataHookSelector

from earl_lightning.modules import AgenticRLModule
from earl_lightning.modules.datamodule import EpisodeDataModule


def test_specs_pass_through_uncopied_and_lightning_uses_this_hook():
    dm = EpisodeDataModule(env="connect_four", batch_size=8, group_size=4, eval_episodes=0)
    batch = next(iter(dm.train_dataloader()))
    moved = dm.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert moved is batch and all(a is b for a, b in zip(moved["specs"], batch["specs"]))
    assert len(batch["specs"]) == 8 and batch["step"] == 0
    selector = _DataHookSelector(AgenticRLModule.__new__(AgenticRLModule), dm)
    assert selector.get_instance("transfer_batch_to_device") is dm

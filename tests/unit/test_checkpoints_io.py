"""AtomicCheckpointIO, the checkpoint writer `earl fit` gives every strategy, and when a recipe's own stands."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from earl_lightning.checkpoints.io import AtomicCheckpointIO, by_index, with_atomic_checkpoint_io


def test_a_save_is_the_file_alone(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "w": torch.ones(2)}, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    assert AtomicCheckpointIO().load_checkpoint(path, weights_only=True)["global_step"] == 3


def test_storage_options_are_refused_as_lightning_does(tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "last.ckpt", storage_options={"x": 1})


def test_added_unless_the_recipe_names_its_own_writer():
    assert [type(p) for p in with_atomic_checkpoint_io(None, "auto")] == [AtomicCheckpointIO]
    added = with_atomic_checkpoint_io("bf16-mixed", "ddp")
    assert added[0] == "bf16-mixed" and isinstance(added[1], AtomicCheckpointIO)
    assert with_atomic_checkpoint_io([TorchCheckpointIO()], "auto") is None
    assert with_atomic_checkpoint_io(None, DDPStrategy(checkpoint_io=TorchCheckpointIO())) is None
    assert isinstance(with_atomic_checkpoint_io(None, DDPStrategy())[0], AtomicCheckpointIO)


def test_an_optimizer_state_by_name_is_keyed_by_index_again():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(
        [{"params": model[1].parameters(), "lr": 0.1}, {"params": model[0].parameters(), "lr": 0.2}]
    )
    model(torch.ones(5, 3)).sum().backward()
    optimizer.step()
    by_name = get_optimizer_state_dict(model, optimizer)
    assert by_name["param_groups"][0]["params"] == ["1.weight", "1.bias"]
    again, plain = by_index(by_name), optimizer.state_dict()
    assert again["param_groups"] == plain["param_groups"]
    assert again["state"].keys() == plain["state"].keys()
    for index, state in plain["state"].items():
        for key, value in state.items():
            assert torch.equal(again["state"][index][key], value), (index, key)


def test_a_file_save_replaces_a_dcp_directory(tmp_path):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / ".metadata").write_bytes(b"old")
    AtomicCheckpointIO().save_checkpoint({"global_step": 2}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(path, weights_only=True) == {"global_step": 2}

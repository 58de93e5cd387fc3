"""A default `earl fit` console is quiet and truthful: no warning from earl_lightning's own code (its
console's logger included) or from its use of Lightning, and a progress bar that counts steps against `max_steps`, without `v_num`.

Only `--trainer.*` and `--data.*` overrides are passed, so the recipe's `model:` section may change freely.
"""

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader, IterableDataset

import earl_lightning
from earl_lightning.callbacks import StepProgressBar
from earl_lightning.cli import main
from earl_lightning.core.warnings_filter import install_warning_filters

RECIPE = Path(__file__).parents[2] / "recipes" / "connect4_ppo.yaml"
PACKAGE_DIR = str(Path(earl_lightning.__file__).parent)
# Warnings Lightning raises because of how this project uses it (manual optimization with step
# checkpoints; its own pytree helper on this torch), spelled out here rather than read from
# earl_lightning.core.warnings_filter so that dropping a filter fails this test.
LIGHTNING_USE = (
    "Using ModelCheckpoint with manual optimization and every_n_train_steps",
    "`isinstance(treespec, LeafSpec)` is deprecated",
)


def fit_args(root: Path) -> list[str]:
    return [
        "fit",
        "--config",
        str(RECIPE),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(root),
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "4",
    ]


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    # As when run as `earl`: LightningCLI warns if pytest's own argv sits beside main(args).
    monkeypatch.setattr(sys, "argv", ["earl"])


def test_default_fit_emits_no_warning_of_ours(tmp_path, capsys, caplog):
    # A checkpoint every step, so that 2 steps reach ModelCheckpoint's manual-optimization save (the
    # recipe's own checkpoint saves every 20 steps).
    args = fit_args(tmp_path) + [
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps",
        "1",
    ]
    with warnings.catch_warnings(record=True) as caught:
        # "always" overrides pytest's filterwarnings (pyproject ignores DeprecationWarning) and the
        # once-per-location default; main() puts the project's narrow filters in front of it.
        warnings.simplefilter("always")
        warnings.warn("sanity: recording works", DeprecationWarning, stacklevel=2)
        main(args)
    assert any(str(w.message) == "sanity: recording works" for w in caught), (
        "warnings are not recorded"
    )
    bad = [
        w
        for w in caught
        if w.filename.startswith(PACKAGE_DIR) or str(w.message).startswith(LIGHTNING_USE)
    ]
    assert not bad, "\n".join(
        f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in bad
    )
    # the package's own warnings go through earl_lightning.core.console: none in a default run either
    ours = [r.getMessage() for r in caplog.records if r.name == "earl_lightning"]
    assert not [
        r for r in caplog.records if r.name == "earl_lightning" and r.levelno >= logging.WARNING
    ], ours
    assert list(tmp_path.rglob("*step=*.ckpt")), "the per-step checkpoint was not saved"
    out = capsys.readouterr().out
    assert "2/2" in out and "v_num" not in out and "Epoch 0/-2" not in out, out[-2000:]


def test_filters_match_only_the_library_internal_call_site():
    from lightning.pytorch.utilities._pytree import _tree_flatten

    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use ..."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install_warning_filters()
        _tree_flatten(1)  # Lightning's own construction of a LeafSpec: silenced
        warnings.warn(leaf, FutureWarning, stacklevel=2)  # the same words from elsewhere still show
        warnings.warn(LIGHTNING_USE[0], UserWarning, stacklevel=2)
    assert [str(w.message) for w in caught] == [leaf, LIGHTNING_USE[0]]


class _SetupProbe(Callback):
    """Records the trainer's progress bar at setup, then stops the run before any work."""

    progress_bar: object = "unset"

    def setup(self, trainer, pl_module, stage):
        _SetupProbe.progress_bar = trainer.progress_bar_callback
        raise _Stop


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], StepProgressBar),
        (["--trainer.callbacks+=TQDMProgressBar"], TQDMProgressBar),  # the user's own bar wins
        (["--trainer.enable_progress_bar", "false"], type(None)),
    ],
    ids=["default", "user_bar", "disabled"],
)
def test_cli_progress_bar_is_a_default_the_user_overrides(extra, expected, tmp_path):
    _SetupProbe.progress_bar = "unset"
    with pytest.raises(_Stop):
        main(fit_args(tmp_path) + extra + [f"--trainer.callbacks+={__name__}._SetupProbe"])
    assert type(_SetupProbe.progress_bar) is expected


class _Forever(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.ones(1)


class _Tiny(LightningModule):
    """One manual optimizer step per training step, like an RL iteration."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.linear = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.linear(batch).sum())
        opt.step()
        opt.zero_grad()
        self.log("reward/mean", 0.5, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_Forever(), batch_size=None)


class _BarTextAt(Callback):
    def __init__(self, step: int):
        self.step, self.text = step, ""

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step == self.step:
            self.text = str(trainer.progress_bar_callback.train_progress_bar)
            trainer.should_stop = True


def test_step_progress_bar_reads_step_of_max_steps(tmp_path):
    install_warning_filters()  # importing earl_lightning.callbacks did, but pytest resets filters after collection
    probe = _BarTextAt(3)  # after the bar in the list: it reads what the bar has just drawn
    trainer = Trainer(
        max_steps=10,
        default_root_dir=tmp_path,
        callbacks=[StepProgressBar(), probe],
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(_Tiny())
    assert "step" in probe.text and "3/10" in probe.text, probe.text
    assert "reward/mean=0.5" in probe.text, probe.text
    # a logger is on (default TensorBoard): its version is not shown
    assert "v_num" not in probe.text, probe.text

"""Every private of Lightning, LightningCLI and its parser (jsonargparse, argparse) the package
touches, in this module only: each function says which private it reads, sets or overrides, and
why no public API serves. A Lightning release that renames one breaks here, in one place, not in
a strategy or a callback (tests/unit/test_lightning_privates.py fails on a private touched anywhere
else in the package). Tier 0: it imports nothing from the project.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

if TYPE_CHECKING:  # the class PatientLaunch's hook overrides, for type checkers' @override checks
    from lightning.pytorch.strategies import ParallelStrategy as _Hooked
else:
    _Hooked = object

# ---- ModelParallelStrategy ----------------------------------------------------------------------


def join_processes(strategy: ModelParallelStrategy) -> None:
    """ModelParallelStrategy's ``_setup_distributed``: the device, the world ranks, the seed reset
    and joining the default process group. Its public ``setup_environment`` does the same and then
    builds a ("data_parallel", "tensor_parallel") mesh sized by its own arguments; EarlStrategy's
    meshes are ("dp", "tp") ones per layout, so it calls this step alone."""
    strategy._setup_distributed()


def process_group_backend(strategy: ModelParallelStrategy) -> str:
    """The backend the strategy will join with (``_get_process_group_backend``: the one given, else
    the device's default). The public ``process_group_backend`` is None until the group is up,
    and EarlStrategy joins torchrun's group itself before that."""
    return strategy._get_process_group_backend()


def process_group_timeout(strategy: ModelParallelStrategy) -> timedelta | None:
    """The ``timeout`` the strategy was built with (``_timeout``; no public property)."""
    return strategy._timeout


def set_module_device_mesh(module: LightningModule, mesh: Any) -> None:
    """Give the module its ``device_mesh`` (``_device_mesh``: the property has no setter; Lightning's
    ModelParallelStrategy sets the private the same way)."""
    module._device_mesh = mesh


@contextmanager
def configure_model_optional(module: LightningModule) -> Iterator[None]:
    """Inside: ModelParallelStrategy's ``setup`` takes a module that does not override
    ``configure_model``. It refuses one (``is_overridden``), since there the module must shard
    itself; under EarlStrategy the strategy has sharded the module's models already. The check
    reads the module's attribute, so a no-op ``configure_model`` is set on the instance for the
    call and removed after it (a module that overrides the hook is left as it is)."""
    if type(module).configure_model is not LightningModule.configure_model:
        yield
        return

    def configure_model() -> None:  # the strategy shards: nothing for the module to do
        return None

    module.__dict__["configure_model"] = configure_model
    try:
        yield
    finally:
        module.__dict__.pop("configure_model", None)


# ---- Trainer, LightningModule, launcher ----------------------------------------------------------


def attached_trainer(module: LightningModule) -> Any:
    """The module's trainer, or None before it is attached (``_trainer``: the public ``trainer``
    raises when none is attached, and the set-up's collectives run before)."""
    return module._trainer


def running_hook(module: LightningModule) -> str | None:
    """The name of the Lightning hook running now (``_current_fx_name``; no public accessor)."""
    return module._current_fx_name


def launched_here(strategy: Strategy) -> bool:
    """Whether this process started the other ranks (``earl fit --trainer.devices N``): Lightning's
    ``_SubprocessScriptLauncher``, the only launcher that can ``kill`` them; no public type."""
    return isinstance(strategy.launcher, _SubprocessScriptLauncher)


#: Seconds the process that started the ranks has, once one of them died, to end the run itself
#: (the one-line error, exit 1) before Lightning's watch kills it and every rank.
LOST_PEER_GRACE_S = 30.0


class _PatientObserver(_ChildProcessObserver):
    """Lightning's watch over the ranks this process started (``_ChildProcessObserver``, a daemon
    thread): when one has died it kills the others and this process at once (SIGKILL, exit -9, a
    "zombies" line instead of the run's own error). A survivor sees the lost peer in its next
    collective and ends the run in one line; on a loaded machine that takes longer than the watch's
    5 s poll, so this one waits LOST_PEER_GRACE_S first. A run that ends meanwhile takes the daemon
    thread with it; one stuck past the grace is killed as before."""

    @override
    def _terminate_all(self) -> None:
        time.sleep(LOST_PEER_GRACE_S)
        super()._terminate_all()


class PatientLauncher(_SubprocessScriptLauncher):
    """Lightning's ``_SubprocessScriptLauncher`` with the :class:`_PatientObserver`. Its
    ``launch`` is the parent's five lines with the observer swapped: the parent starts its own
    through a module-level function, with no hook to give it another."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(
            num_devices=self.num_processes, num_nodes=self.num_nodes
        )
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _PatientObserver(main_pid=os.getpid(), child_processes=self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class PatientLaunch(_Hooked):
    """Mixin for a Lightning strategy (before its Lightning base): the ranks it starts itself
    (``earl fit --trainer.devices N``) are watched by :class:`PatientLauncher`. It overrides
    ``_configure_launcher``, where DDP and ModelParallel strategies pick their launcher (no public
    hook: the ``launcher`` property has no setter)."""

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        launcher = self._launcher
        if type(launcher) is _SubprocessScriptLauncher:
            self._launcher = PatientLauncher(
                launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
            )


def own_checkpoint_io(strategy: Strategy) -> Any:
    """The CheckpointIO a strategy instance was built with, or None (``_checkpoint_io``: the public
    ``checkpoint_io`` makes a default one when none was given, so it cannot tell)."""
    return strategy._checkpoint_io


# ---- LightningCLI and its parser ----------------------------------------------------------------


class CLIHooks(LightningCLI):
    """LightningCLI whose two private steps are public hooks here: ``check_ckpt_path`` (Lightning's
    ``_parse_ckpt_path``: reading the ``--ckpt_path`` file's hyperparameters) and
    ``run_subcommand`` (``_run_subcommand``: calling ``trainer.fit`` and the like). They are the
    only points between parsing and the run where ``earl`` can check a checkpoint before anything
    reads it and name a full disk; LightningCLI has no public hook there."""

    @override
    def _parse_ckpt_path(self) -> None:
        self.check_ckpt_path()

    def check_ckpt_path(self) -> None:
        """Lightning's: merge the ``--ckpt_path`` file's hyperparameters into the config."""
        super()._parse_ckpt_path()

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        self.run_subcommand(subcommand)

    def run_subcommand(self, subcommand: str) -> None:
        """Lightning's: run the subcommand's Trainer method with its instantiated arguments."""
        super()._run_subcommand(subcommand)


def parser_actions(parser: Any) -> list[Any]:
    """The parser's actions (argparse's ``_actions``): every option it takes, for the list of
    valid keys an error shows; argparse offers no public list."""
    return list(parser._actions)


def action_typehint(action: Any) -> Any:
    """The type an action of jsonargparse's parses (``ActionTypeHint._typehint``), None for other
    actions: a group typed as a dataclass lists no option per field, so its fields are read here."""
    return getattr(action, "_typehint", None)


# ---- the training loop's logging cadence ---------------------------------------------------------


def logging_step(trainer: Any) -> tuple[int, bool]:
    """During a training step: the x-axis value Lightning logs this step's metrics at and whether
    it writes the loggers this step (the fit loop's ``_batches_that_stepped`` and the logger
    connector's ``should_update_logs``). No public API gives either; the module writes its step
    metrics to the loggers itself, at the step and cadence Lightning's own ``self.log`` values get
    (``self.log`` costs about a millisecond per scalar: it moves each value's result metric to the
    value's device, deep copies included)."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    return step, bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)

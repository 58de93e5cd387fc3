"""``earl fit`` / ``earl validate``: :class:`EarlCLI`, LightningCLI over :class:`AgenticRLModule`
and :class:`EpisodeDataModule`, and the one-line error helpers every ``earl`` subcommand shares
(:func:`say`, :func:`refuse`). The ``earl`` entry point itself is :mod:`earl_lightning.cli`."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

# Imported for its side effect: registers "earl" in Lightning's StrategyRegistry, so a recipe's
# `trainer.strategy: earl` resolves.
import earl_lightning.strategies  # noqa: F401,E402
from earl_lightning.callbacks import ExportModel, StepProgressBar
from earl_lightning.checkpoints import files as checkpoints
from earl_lightning.checkpoints.files import disk_full_error
from earl_lightning.checkpoints.io import AtomicCheckpointIO, with_atomic_checkpoint_io
from earl_lightning.checkpoints.urls import download_checkpoint, is_url
from earl_lightning.cli.resume import (
    check_readable,
    dcp_problem,
    dcp_whole_line,
    differences,
    differences_line,
    saved_hparams,
    with_run_seed,
)
from earl_lightning.core import console
from earl_lightning.core.checks import is_int
from earl_lightning.core.errors import EarlError
from earl_lightning.core.lightning_internals import CLIHooks
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.rl import AgenticRLModule
from earl_lightning.strategies.earl import EarlStrategy  # noqa: E402
from earl_lightning.strategies.faults import one_line_strategy  # noqa: E402


@contextlib.contextmanager
def disk_full_as_one_line(where: Callable[[], str]) -> Iterator[None]:
    """A full disk inside the block is re-raised as one :class:`DiskFullError` line naming
    ``where()`` (the outputs being written); every other error passes through unchanged."""
    try:
        yield
    except EarlError:
        raise
    except Exception as err:
        full = disk_full_error(err, where())
        if full is None:
            raise
        raise full from None


def group_error(message: str) -> str:
    """A group typed ``Optional[...]`` (``--model.peft``) that fails to build is reported by
    jsonargparse as why each type of the union failed; the group's own error, the line that names
    a ``--flag``, is the one line to show."""
    if "Union subtypes" in message:
        named = [
            line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- `--")
        ]
        if named:
            return named[0]
    return message


def refuse(problem: str) -> NoReturn:
    """A bad argument found before anything is built: one line, exit 2."""
    console.error(f"earl: error: {problem}")
    raise SystemExit(2)


def is_keyword(path: Any) -> bool:
    """One of Lightning's ``--ckpt_path`` keywords (``last`` is resolved here, the others by Lightning)."""
    text = str(path).lower()
    return text in ("best", "last", "hpc") or text.startswith("registry")


class EarlCLI(CLIHooks):
    """``earl fit`` / ``validate``: LightningCLI whose ``--seed_everything`` is 0 unless given (a run
    is reproducible by default), and that one seed drives every part whose own seed is unset."""

    def __init__(self, *args: Any, seed_everything_default: bool | int = 0, **kwargs: Any) -> None:
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        named = argv[0] if isinstance(argv, list) and argv else None
        every = LightningCLI.subcommands()
        # LightningCLI builds a parser for each subcommand it lists (~0.3 s of CPU at every start
        # for the three that will not run): only the one the command line names, when it names
        # one; `earl --help` and a command line that names none list them all
        self._subcommands = {named: every[named]} if named in every else every
        super().__init__(*args, seed_everything_default=seed_everything_default, **kwargs)

    @override
    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        """LightningCLI's subcommands this command line can run (see ``__init__``)."""
        return self._subcommands

    def before_instantiate_classes(self) -> None:
        # `--model.seed` / `--data.seed` unset: the run's seed, written into the config (what the
        # saved config.yaml and the checkpoints' hyperparameters then record)
        config = self.config[self.subcommand] if self.subcommand else self.config
        dump = config.get("dump_episodes")
        if dump and config.get("model") is not None and "transcripts" in config["model"]:
            config["model"]["transcripts"]["dump"] = dump  # `--model.transcripts.dump`
        seed = config.get("seed_everything")
        if not is_int(seed):
            return
        for group in ("model", "data"):
            part = config.get(group)
            if part is not None and "seed" in part and part["seed"] is None:
                part["seed"] = seed

    def add_arguments_to_parser(self, parser) -> None:
        # `earl fit` ends by writing the trained model as a save_pretrained directory
        # (`--export.dirpath`, `--export.enabled false`); validate and test write nothing.
        parser.add_lightning_class_args(ExportModel, "export")
        parser.add_argument(
            "--dump_episodes",
            type=Optional[str],  # noqa: UP045 - a runtime type for jsonargparse
            default=None,
            help=DUMP_HELP,
        )

    @override
    def check_ckpt_path(self) -> None:
        # Lightning reads a `--ckpt_path` file's hyperparameters here with a bare torch.load, and
        # loads a URL with weights_only=False. Here a URL is downloaded first, and the file (or a
        # DCP directory's pickled .metadata) is checked readable as data only: a planted, truncated
        # or corrupt file is a bad argument, one line before anything is built. Not LightningCLI's
        # merge of the checkpoint's hyperparameters into the config either (a model or import path
        # saved in a checkpoint would run unasked): the config wins, a difference is one line
        # (`_check_resume`).
        self._downloaded: Path | None = None
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else {}
        if config.get("weights_only") is False:
            refuse(
                "`--weights_only` false: earl reads a checkpoint as data and tensors only "
                "(weights_only), never unpickling code it holds; leave it unset"
            )
        path = config.get("ckpt_path")
        if not path or is_keyword(path):
            return
        if is_url(path):
            try:
                self._downloaded = download_checkpoint(str(path), "--ckpt_path")
            except EarlError as err:  # it names the URL
                refuse(str(err))
        try:
            check_readable(self._downloaded or path)
        except EarlError as err:
            arg = (
                f"`--ckpt_path` {str(path)!r} (downloaded)" if self._downloaded else "`--ckpt_path`"
            )
            refuse(f"{arg}: {err}")

    @override
    def run_subcommand(self, subcommand: str) -> None:
        kwargs = self.config_init[subcommand]
        if self._downloaded is not None:  # the config keeps the URL; the run reads the copy
            kwargs["ckpt_path"] = str(self._downloaded)
        kwargs["weights_only"] = True  # (a recipe's own CheckpointIO: Lightning's load)
        self._resolve_last_checkpoint(subcommand)
        self._check_outputs(subcommand)
        self._check_resume(subcommand)
        # A full disk under any strategy and any writer (checkpoints, TensorBoard, config.yaml) is
        # one line naming where the run writes; EarlStrategy names the checkpoint itself.
        # (default_root_dir, not log_dir: the latter is a broadcast, and a full disk may stop one rank only.)
        with disk_full_as_one_line(
            lambda: f"the run's outputs under {str(self.trainer.default_root_dir)!r}"
        ):
            super().run_subcommand(subcommand)

    def _resolve_last_checkpoint(self, subcommand: str) -> None:
        """``--ckpt_path last``: the newest ``last*.ckpt`` in any directory this run's checkpoint
        callbacks write to (every logger version: Lightning looks only in this launch's, a new
        one, so a relaunched run would silently start over); nothing else under the root is a
        candidate. What is read of it first is checked readable as data only (:func:`check_readable`)."""
        kwargs = self.config_init.get(subcommand, {})
        if str(kwargs.get("ckpt_path")) != "last":
            return
        found = checkpoints.newest_last_checkpoint(self._checkpoint_dirs())
        kwargs["ckpt_path"] = None if found is None else str(found)
        if found is not None and found.name.endswith(".old") and self.trainer.is_global_zero:
            console.info(
                f"earl: the save that replaced {str(found.parent / found.name[1:-4])!r} was interrupted; resuming "
                f"from the previous checkpoint, {str(found)!r}"
            )
        if found is not None:
            check_readable(found)  # planted, truncated or corrupt: one line (exit 1)
        if found is None and self.trainer.is_global_zero:
            console.info(
                f"earl: no checkpoint named last*.ckpt under {str(self.trainer.default_root_dir)!r}: "
                "starting from the beginning"
            )

    def _check_resume(self, subcommand: str) -> None:
        """The ``--ckpt_path`` the run will load (``last`` resolved): a DCP directory under a strategy
        that reads single files is loaded whole, said in one line (refused, exit 2, under a
        recipe's own CheckpointIO); the settings this run's config gives otherwise than the
        checkpoint saved them are one line (the config's are used)."""
        config, trainer = self.config[subcommand], self.trainer
        path = self.config_init[subcommand].get("ckpt_path")
        if not path or not Path(path).exists():
            return
        strategy = trainer.strategy
        if Path(path).is_dir() and not isinstance(strategy, EarlStrategy):
            # Loaded whole by AtomicCheckpointIO; a recipe's own CheckpointIO reads single files.
            named = config["trainer"].get("strategy")
            problem = (
                None
                if isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
                else dcp_problem(path, named if isinstance(named, str) else type(strategy).__name__)
            )
            if trainer.is_global_zero:
                if problem is None:
                    console.info(dcp_whole_line(path, trainer.world_size))
                else:
                    console.error(f"earl: error: {problem}")
            if problem is not None:
                raise SystemExit(2)
        try:
            saved = saved_hparams(path)
        except Exception:  # noqa: BLE001 - an unreadable file is named by the load that follows
            return
        seed = config.get("seed_everything")  # a part's unset seed is the run's
        found = [
            *differences(saved["model"], with_run_seed(config["model"].as_dict(), seed), "--model"),
            *differences(saved["data"], with_run_seed(config["data"].as_dict(), seed), "--data"),
        ]
        line = differences_line(path, found)
        if line is not None and trainer.is_global_zero:
            console.warn(line)

    def _check_outputs(self, subcommand: str) -> None:
        """Before anything runs: the root is a directory, not inside the checkpoint read (a save
        may replace that), and an ExportModel's ``--export.dirpath`` can be written without
        deleting what the run keeps (:meth:`ExportModel.problem`). One line, exit 2."""
        trainer, ckpt = self.trainer, self.config_init[subcommand].get("ckpt_path")
        root = trainer.default_root_dir
        arg = "--trainer.default_root_dir"
        problem = (
            f"`{arg}` {str(root)!r} is a file; it must be a directory (the run's logs and checkpoints)"
            if Path(root).is_file()
            else None
        )
        if problem is None:
            read = f"the checkpoint the run reads (`--ckpt_path` {str(ckpt)!r})"
            problem = checkpoints.inside_problem(root, arg, ckpt, read)
        for callback in trainer.callbacks if subcommand == "fit" else []:
            if problem is None and isinstance(callback, ExportModel):
                problem = callback.problem(trainer, ckpt)
        if problem is not None:
            if trainer.is_global_zero:
                console.error(f"earl: error: {problem}")
            raise SystemExit(2)

    def _checkpoint_dirs(self) -> list[Path]:
        """Where the trainer's checkpoint callbacks write, in every logger version (Lightning's
        ``ModelCheckpoint.__resolve_ckpt_dir``, without fixing this launch's version)."""
        trainer, dirs = self.trainer, []
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None) is not None:
                dirs.append(Path(callback.dirpath))
            elif trainer.loggers:
                logger = trainer.loggers[0]
                dirs += Path(logger.save_dir or trainer.default_root_dir, str(logger.name)).glob(
                    "*/checkpoints"
                )
            else:
                dirs.append(Path(trainer.default_root_dir) / "checkpoints")
        return dirs

    def instantiate_classes(self) -> None:
        # Bad input is reported as one clear line naming the argument, not a traceback from deep inside.
        try:
            super().instantiate_classes()
            if isinstance(self.model, AgenticRLModule) and isinstance(
                self.datamodule, EpisodeDataModule
            ):
                self.model.check_data(self.datamodule, self.trainer.world_size)
                if self.model.peft_config is not None and isinstance(
                    self.trainer.strategy, EarlStrategy
                ):
                    self.trainer.strategy.refuse_lora_tp("--trainer.strategy.")
        except (ValueError, FileNotFoundError, ImportError) as err:
            console.error(f"earl: error: {group_error(str(err))}")
            raise SystemExit(2) from None

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # The step-counting bar is the default, added here rather than through `trainer_defaults`
        # (which LightningCLI appends to every run): a recipe's own progress bar wins, and
        # `--trainer.enable_progress_bar false` still means no bar.
        config = self.config_init.get(str(self.subcommand), self.config_init).get("trainer") or {}
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            kwargs.setdefault("callbacks", [*callbacks, StepProgressBar()])
        # Several processes under `strategy: auto` / `ddp`: Lightning's DDP whose collectives end a
        # lost peer in one line, as EarlStrategy's do.
        strategy = one_line_strategy(
            config.get("strategy", "auto"),
            config.get("devices", "auto"),
            config.get("num_nodes", 1),
        )
        if strategy is not config.get("strategy", "auto"):
            kwargs.setdefault("strategy", strategy)
        # Checkpoints are written atomically under every strategy (Lightning's own writer is not).
        plugins = with_atomic_checkpoint_io(
            config.get("plugins"), config.get("strategy"), self.model
        )
        if plugins is not None:
            kwargs.setdefault("plugins", plugins)
        return super().instantiate_trainer(**kwargs)


# `earl --help`: LightningCLI lists its own subcommands (fit, validate, test, predict) only


DUMP_HELP = (
    "Append every episode of every step and evaluation to this file as one JSON line (the "
    "row or env seed, the messages in TRL's form, rewards, tool calls, errors): "
    "--model.transcripts.dump."
)

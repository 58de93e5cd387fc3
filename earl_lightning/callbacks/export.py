"""ExportModel: at the end of a fit, the trained policy as a ``save_pretrained`` directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from earl_lightning.checkpoints.export import EXPORT_DIRNAME, gather_state_dict, write_pretrained
from earl_lightning.checkpoints.files import inside_problem, output_dir_problem, overlap_problem
from earl_lightning.core.errors import EarlError

DIRPATH = "--export.dirpath"


@runtime_checkable
class PretrainedSource(Protocol):
    """A LightningModule whose causal LM and tokenizer are ``policy`` and ``tokenizer``
    (AgenticRLModule and WarmStartModule are)."""

    policy: Any
    tokenizer: Any


class ExportModel(L.Callback):
    """When a fit ends, write the policy, its generation config and its tokenizer (with the chat
    template) as a ``save_pretrained`` directory that transformers and vLLM load. Sharded weights
    (FSDP2 / tensor parallel under EarlStrategy) are gathered whole; rank 0 writes, into a
    temporary sibling that is then renamed into place. ``earl fit`` adds it (``--export.*``).

    Args:
        dirpath: where to write. Default: ``hf_model`` beside the checkpoint directory (the
            ModelCheckpoint's ``dirpath``'s parent; without checkpointing, the run's log
            directory), e.g. ``<default_root_dir>/lightning_logs/version_0/hf_model``. Given, it is
            checked when the fit starts: not a file, empty unless ``overwrite``, and never the
            run's root, log or checkpoint directory nor the checkpoint it resumes from, nor a
            directory holding one of them (writing it replaces the whole directory).
        enabled: false: write nothing.
        overwrite: replace ``dirpath`` when it exists and is not empty.

    Raises:
        EarlError: when a fit starts, a ``dirpath`` that cannot take the model (:meth:`problem`
            says why), before any step runs.
    """

    def __init__(
        self, dirpath: str | None = None, enabled: bool = True, overwrite: bool = False
    ) -> None:
        self.dirpath = dirpath
        self.enabled = enabled
        self.overwrite = overwrite
        self.last_path: Path | None = None  # where the last fit's model was written

    def problem(self, trainer: L.Trainer, ckpt_path: Any) -> str | None:
        """Why ``dirpath`` cannot take the model at the end of a fit (None: it can); ``ckpt_path``
        is the checkpoint the fit resumes from."""
        if not self.enabled or self.dirpath is None:
            return None
        return output_dir_problem(
            self.dirpath, self.overwrite, DIRPATH, "--export.overwrite true"
        ) or self._overlap(trainer, ckpt_path)

    def _overlap(self, trainer: L.Trainer, ckpt_path: Any) -> str | None:
        """Why writing ``dirpath``, which replaces it whole, would delete what the run keeps: its
        root, logs, checkpoints, the checkpoint it resumed from (None: it would not)."""
        root = trainer.default_root_dir
        read = f"the checkpoint the run reads ({str(ckpt_path)!r})"
        kept = [(root, f"the run's root (`--trainer.default_root_dir` {str(root)!r})")]
        kept += [
            (logger.save_dir, f"the run's logs ({str(logger.save_dir)!r})")
            for logger in trainer.loggers
            if logger.save_dir is not None
        ]
        kept += [
            (callback.dirpath, f"the run's checkpoints ({str(callback.dirpath)!r})")
            for callback in trainer.checkpoint_callbacks
            if getattr(callback, "dirpath", None) is not None
        ]
        return overlap_problem(self.dirpath, DIRPATH, [*kept, (ckpt_path, read)]) or inside_problem(
            self.dirpath, DIRPATH, ckpt_path, read
        )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before any training (`earl fit` checks it before the fit, to say it in one line)
        problem = self.problem(trainer, trainer.ckpt_path) if stage == "fit" else None
        if problem is not None:
            raise EarlError(problem)

    def resolve_dirpath(self, trainer: L.Trainer) -> Path:
        """Where this fit's model goes: ``dirpath`` as given, else ``hf_model`` beside the
        checkpoint directory, else in the run's log directory."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        checkpoints = trainer.checkpoint_callback
        if isinstance(checkpoints, ModelCheckpoint) and checkpoints.dirpath:
            return Path(checkpoints.dirpath).parent / EXPORT_DIRNAME
        return Path(trainer.log_dir or trainer.default_root_dir) / EXPORT_DIRNAME

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        if not isinstance(pl_module, PretrainedSource):
            raise TypeError(
                f"ExportModel needs a module with `policy` and `tokenizer` (a causal LM and its "
                f"tokenizer); {type(pl_module).__name__} has not"
            )
        # Checked again now that the checkpoint directory is resolved (a ModelCheckpoint's default
        # is the logger's version directory, unknown when the fit starts): never replaced.
        problem = None if self.dirpath is None else self._overlap(trainer, trainer.ckpt_path)
        if problem is not None:
            raise EarlError(f"the trained model was not exported: {problem}")
        out = Path(trainer.strategy.broadcast(str(self.resolve_dirpath(trainer))))
        # every rank: a collective
        state = gather_state_dict(pl_module.policy, keep=trainer.is_global_zero)
        if trainer.is_global_zero:
            write_pretrained(pl_module.policy, pl_module.tokenizer, out, state)
            print(
                f"earl: the trained model is in {str(out)!r} (save_pretrained: transformers, vLLM, "
                f"--model.model)"
            )
        trainer.strategy.barrier("earl_export")
        self.last_path = out

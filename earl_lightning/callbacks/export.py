"""ExportModel: at the end of a fit, the trained policy as a ``save_pretrained`` directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from earl_lightning.export import EXPORT_DIRNAME, gather_state_dict, write_pretrained


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
            directory), e.g. ``<default_root_dir>/lightning_logs/version_0/hf_model``.
        enabled: false: write nothing.
    """

    def __init__(self, dirpath: str | None = None, enabled: bool = True) -> None:
        self.dirpath = dirpath
        self.enabled = enabled
        self.last_path: Path | None = None  # where the last fit's model was written

    def resolve_dirpath(self, trainer: L.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        checkpoints = trainer.checkpoint_callback
        if isinstance(checkpoints, ModelCheckpoint) and checkpoints.dirpath:
            return Path(checkpoints.dirpath).parent / EXPORT_DIRNAME
        return Path(trainer.log_dir or trainer.default_root_dir) / EXPORT_DIRNAME

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        if not isinstance(pl_module, PretrainedSource):
            raise TypeError(
                f"ExportModel needs a module with `policy` and `tokenizer` (a causal LM and its "
                f"tokenizer); {type(pl_module).__name__} has not"
            )
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

"""Saving the warm start: model, tokenizer and ``warm_start.json``, written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from earl_lightning.checkpoints import files as checkpoints
from earl_lightning.checkpoints.files import write_dir_atomically

WARM_START_FILE = "warm_start.json"
# the demonstration policy's settings, which a dataset's warm start does not use
POLICY_SETTINGS = ("policy", "policy_kwargs", "num_episodes", "targets")


def used_settings(datamodule: Any) -> dict[str, Any]:
    """The data settings the warm start used: not LightningCLI's ``_instantiator``, and not the
    demonstration policy's when a dataset was trained on."""
    unused = POLICY_SETTINGS if datamodule.splits is not None else ()
    return {
        k: v for k, v in datamodule.hparams.items() if not k.startswith("_") and k not in unused
    }


def save_warm_start(
    trainer: Any, module: Any, datamodule: Any, output_dir: str, wall_s: float
) -> Path | None:
    """Rank 0 saves ``module``'s model and tokenizer (``save_pretrained``) and ``warm_start.json`` (the
    last held-out evaluation, greedy ``val/*`` and temperature-1 ``val_sampled/*``, what it
    measures in words, the demonstrations' figures, the settings used) into a temporary sibling of ``output_dir``, then
    renames it into place: an interrupted save leaves the old directory whole, never half of one."""
    trainer.strategy.barrier("earl_sft_save")
    if not trainer.is_global_zero:
        return None
    record = {
        "evaluation": {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith(("val/", "val_sampled/"))
        },
        "demonstrations": datamodule.stats,
        "steps": trainer.global_step,
        "wall_s": round(wall_s, 1),
        "model": module.hparams.model,
        "evaluation_measures": datamodule.evaluation_note(),
        "data": used_settings(datamodule),
        "rollout": module.hparams.rollout,
    }

    def write(tmp: Path) -> None:
        module.save_pretrained(str(tmp))
        (tmp / WARM_START_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")

    out = write_dir_atomically(output_dir, write)
    print(
        f"earl: warm start saved to {str(out)!r} ({trainer.global_step} steps, {wall_s:.0f} s); "
        f"load it with --model.model {str(out)}"
    )
    return out


def read_warm_start(directory: str) -> dict[str, Any]:
    """The ``warm_start.json`` of a saved warm start."""
    return json.loads((Path(directory) / WARM_START_FILE).read_text())


def output_dir_problem(
    output_dir: str | None, overwrite: bool, root: str | None = None, model: str | None = None
) -> str | None:
    """Why ``--output_dir`` cannot take the warm start (None: it can): unset, a file, not empty
    without ``overwrite``, or the directory of the run's logs (``root``, the working directory
    when unset) or of the model it reads (``model``), or one holding them: the save replaces
    the whole directory. Also a ``--trainer.default_root_dir`` that is a file. Checked before any work."""
    if not output_dir:
        return "`--output_dir` is required: the directory the warm-start model is saved to"
    root = os.getcwd() if root is None else root
    if Path(root).is_file():
        return f"`--trainer.default_root_dir` {root!r} is a file; it must be a directory (the run's logs)"
    kept = [
        (root, f"the run's root (`--trainer.default_root_dir` {str(root)!r})"),
        (
            model if model and Path(model).exists() else None,
            f"the model read (`--model.model` {model!r})",
        ),
    ]
    return checkpoints.output_dir_problem(
        output_dir, overwrite, "--output_dir"
    ) or checkpoints.overlap_problem(output_dir, "--output_dir", kept)

"""The ``earl`` command: ``earl_lightning.cli:main`` is its console script, and ``python -m
earl_lightning.cli`` (how ``torchrun`` starts it) runs the same.

:mod:`.entry` dispatches the subcommands; :mod:`.fit` is LightningCLI's ``fit`` and ``validate``
(``EarlCLI``), :mod:`.sft` the warm start's, :mod:`.resume` what ``--ckpt_path`` brings and
:mod:`.argument_errors` the one-line argument errors. ``main`` and ``EarlCLI`` are imported on
first use (PEP 562), so importing one submodule does not import the whole command.
"""

from __future__ import annotations

import importlib

__all__ = ["EarlCLI", "main"]

_WHERE = {"main": "earl_lightning.cli.entry", "EarlCLI": "earl_lightning.cli.fit"}

# what type checkers and IDEs read (they take any `TYPE_CHECKING` as true)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from earl_lightning.cli.entry import main
    from earl_lightning.cli.fit import EarlCLI


def __getattr__(name: str) -> object:
    """``main`` or ``EarlCLI``, imported from its module on first use and kept here after."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

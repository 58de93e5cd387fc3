"""The ``earl`` command: ``earl_lightning.cli:main`` is its console script, and ``python -m
earl_lightning.cli`` (how ``torchrun`` starts it) runs the same.

:mod:`.entry` dispatches the subcommands; :mod:`.fit` is LightningCLI's ``fit`` and ``validate``
(``EarlCLI``), :mod:`.sft` the warm start's, :mod:`.resume` what ``--ckpt_path`` brings and
:mod:`.argument_errors` the one-line argument errors. ``main`` and ``EarlCLI`` are imported on
first use (PEP 562): a submodule imported alone (the argument errors) pays for no Lightning CLI.

Until 0.3.0 ``earl_lightning.cli`` was the module :mod:`.entry` is now: its other names imported
from here (``DUMP_HELP``, ``own_command``, ...) still give their objects and warn once
(``DeprecationWarning``); removed in 0.4.
"""

from __future__ import annotations

import importlib

from earl_lightning.core.warnings_filter import moved_names

__all__ = ["EarlCLI", "main"]

_WHERE = {"main": "earl_lightning.cli.entry", "EarlCLI": "earl_lightning.cli.fit"}

# what type checkers and IDEs read (they take any `TYPE_CHECKING` as true)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from earl_lightning.cli.entry import main
    from earl_lightning.cli.fit import EarlCLI


_moved = moved_names(__name__, "earl_lightning.cli.entry", removed_in="0.4", stacklevel=3)


def __getattr__(name: str) -> object:
    """``main`` or ``EarlCLI``, imported from its module on first use and kept here after (another
    name of the old module: deprecated, from :mod:`.entry`)."""
    if name not in _WHERE:
        return _moved(name)
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

"""Deprecated: ``earl_lightning.cli_resume`` is ``earl_lightning.cli.resume`` now (moved in 0.3.0).

Importing this module warns once (``DeprecationWarning``) and gives the new module; removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_module

moved_module(__name__, "earl_lightning.cli.resume", removed_in="0.4")

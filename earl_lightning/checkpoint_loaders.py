"""Deprecated: ``earl_lightning.checkpoint_loaders`` is ``earl_lightning.checkpoints.loaders`` now (moved in 0.3.0).

Importing this module warns once (``DeprecationWarning``) and gives the new module; removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_module

moved_module(__name__, "earl_lightning.checkpoints.loaders", removed_in="0.4")

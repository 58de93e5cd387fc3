"""Deprecated: ``earl_lightning.data.episodes`` is ``earl_lightning.batches.episodes`` now ("data" named four things until 0.3.0).

Importing this module warns once (``DeprecationWarning``) and gives the new module; removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_module

moved_module(__name__, "earl_lightning.batches.episodes", removed_in="0.4")

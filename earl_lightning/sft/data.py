"""Deprecated: ``earl_lightning.sft.data`` is ``earl_lightning.sft.datamodule`` now (beside ``modules.datamodule``, as of 0.3.0).

Importing this module warns once (``DeprecationWarning``) and gives the new module; removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_module

moved_module(__name__, "earl_lightning.sft.datamodule", removed_in="0.4")

"""Deprecated: ``earl_lightning.data.datamodule`` is ``earl_lightning.modules.datamodule`` now (the README's path for `EpisodeDataModule` until 0.2.0).

Importing this module warns once (``DeprecationWarning``) and gives the new module; removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_module

moved_module(__name__, "earl_lightning.modules.datamodule", removed_in="0.4")

"""Deprecated: ``earl_lightning.strategies.layouts`` is ``earl_lightning.parallel.layout`` now (the `LayoutSelector` protocol and layout arguments until 0.2.0).

Importing this module warns once (``DeprecationWarning``) and gives the new module; removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_module

moved_module(__name__, "earl_lightning.parallel.layout", removed_in="0.4")

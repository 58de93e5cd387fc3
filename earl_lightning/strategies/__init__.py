"""EarlStrategy (registered in Lightning's StrategyRegistry as "earl" on import)."""

from earl_lightning.parallel.layout import LayoutSelector, to_layout
from earl_lightning.strategies.earl import EarlStrategy

__all__ = ["EarlStrategy", "LayoutSelector", "to_layout"]

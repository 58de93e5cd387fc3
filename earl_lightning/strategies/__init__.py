"""EarlStrategy (registered in Lightning's StrategyRegistry as "earl" on import)."""

from earl_lightning.strategies.earl import EarlStrategy, LayoutSelector, to_layout

__all__ = ["EarlStrategy", "LayoutSelector", "to_layout"]

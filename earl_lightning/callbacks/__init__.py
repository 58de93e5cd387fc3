from earl_lightning.callbacks.adaptive import AdaptiveParallelism

__all__ = ["AdaptiveParallelism"]

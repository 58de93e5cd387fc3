from earl_lightning.modules.rl import AgenticRLModule

__all__ = ["AgenticRLModule"]

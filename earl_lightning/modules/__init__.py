# AgenticRLModule is exported lazily: importing a pure submodule (experience_ops, used by the
# Lightning-free profiler in parallel/) must not import Lightning through this package.
__all__ = ["AgenticRLModule"]


def __getattr__(name: str):
    if name == "AgenticRLModule":
        from earl_lightning.modules.rl import AgenticRLModule

        return AgenticRLModule
    raise AttributeError(f"module 'earl_lightning.modules' has no attribute {name!r}")

"""The batches the RL stages pass along: finished episodes packed into an :class:`ExperienceBatch`.

``experience`` holds the packed per-token batch every stage reads and writes; ``episodes`` turns
finished episodes into one (one row per episode, or per turn). Until 0.3.0 this package was
``earl_lightning.data``.
"""

"""Profiling each RL stage's throughput per context length x sequences x layout.

:mod:`.profiler` measures with the project's own code paths (the HF generation backend, the
experience forward, the train step) under every layout; :mod:`.command` is ``earl profile``. The
table it produces (:class:`~earl_lightning.parallel.throughput.ProfileTable`) is what the layout
selector looks up. This package sits in the top tier: it drives rollout, data and parallel code.
"""

from earl_lightning.profiling.profiler import ProfileGrid, ProfileRun, profile_stages

__all__ = ["ProfileGrid", "ProfileRun", "profile_stages"]

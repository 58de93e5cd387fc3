"""Profiling each RL stage's throughput per context length x sequences x layout.

:mod:`.stages` measures with the project's own code paths (the HF generation backend, the
experience forward, the train step) under every layout (``earl profile`` is
:mod:`earl_lightning.profile_command`). The table it produces (:class:`~earl_lightning.parallel.profile.ProfileTable`) is what the layout
selector looks up. This package sits in the top tier: it drives rollout, data and parallel code.
"""

from earl_lightning.profiling.stages import ProfileGrid, ProfileRun, profile_stages

__all__ = ["ProfileGrid", "ProfileRun", "profile_stages"]

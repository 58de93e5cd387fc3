"""Registers the built-in environments by importing their modules.

``openspiel`` / ``connect_four`` (OpenSpiel games), ``calculator`` (tool use), ``textarena``
(TextArena games) and ``recall`` (a memory task with steadily growing context). None of these imports pulls in TextArena; that happens when a TextArena env is
built, so this module imports fine without the optional extra.
"""

from earl_lightning.envs import calculator, openspiel_env, textarena_env  # noqa: F401
from earl_lightning.envs import recall  # noqa: F401

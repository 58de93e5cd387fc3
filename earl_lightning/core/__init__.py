"""Tier 0: the helpers every layer uses, importing nothing from the project above this package.

Name -> object registries that also take import paths (:mod:`.registry`), typed configuration
groups from dicts (:mod:`.config_groups`), the errors a run ends with in one line (:mod:`.errors`),
the scalar argument checks (:mod:`.checks`), the run's seed for a part whose seed is unset
(:mod:`.seeding`), host-memory retention (:mod:`.host_memory`), the one channel to the user
(:mod:`.console`), the Lightning privates the project touches (:mod:`.lightning_internals`) and
the narrow filters for Lightning's internal warnings (:mod:`.warnings_filter`). ``import
earl_lightning`` imports this package (for the filters), so it imports nothing itself.
"""

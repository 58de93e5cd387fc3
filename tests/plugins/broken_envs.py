"""A plugin module that fails while being imported (the registry must report the import error)."""

raise RuntimeError("plugin is broken on purpose")

"""The project's :class:`~earl_lightning.core.registry.Registry`, re-exported for the algorithm registries."""

from earl_lightning.core.registry import Registry, bind_params, import_object, param_default

__all__ = ["Registry", "bind_params", "import_object", "param_default"]

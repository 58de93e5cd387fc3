"""The package's warnings: the few a library raises from its own internals that no earl_lightning
code can avoid (silenced), and the deprecation of a moved module (raised once, at its import) or
of a name whose module became a package (raised once, at its first use).

Each filter matches one warning by its exact message prefix, its category and the module that emits
it, so the same text raised from anywhere else (earl_lightning included) still shows, and so does any
other warning of that module. Anything the project itself causes is fixed at its cause, not here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import warnings
from collections.abc import Callable

# (message prefix, category, emitting module), each with why it cannot be fixed at the cause.
LIBRARY_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # With manual optimization, ModelCheckpoint(every_n_train_steps=...) warns that the checkpoint holds
    # the state after `optimizer.step()`. One training step here is one whole RL iteration (rollout,
    # experience, update), so that state is exactly the one wanted; Lightning has no option to say so
    # (its only way out is a module with test-only `saved_models` and `layer` attributes).
    (
        "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state was saved",
        UserWarning,
        "lightning.pytorch.callbacks.model_checkpoint",
    ),
    # Lightning's own pytree copy builds torch's `LeafSpec`, which newer torch deprecates; raised from
    # inside Lightning whatever the caller passes.
    (
        "`isinstance(treespec, LeafSpec)` is deprecated",
        FutureWarning,
        "lightning.pytorch.utilities._pytree",
    ),
)


def install_warning_filters() -> None:
    """Add the filters (idempotent: :func:`warnings.filterwarnings` replaces an identical filter)."""
    for prefix, category, module in LIBRARY_WARNINGS:
        warnings.filterwarnings(
            "ignore", message=re.escape(prefix), category=category, module=re.escape(module) + r"\Z"
        )


def moved_module(old: str, new: str, removed_in: str) -> None:
    """Make the deprecated module ``old`` (the shim calling this, at its import) the module ``new``.

    The shim replaces itself in ``sys.modules``, so ``from old import Name`` gets the very objects
    of ``new`` (``isinstance`` checks and registries see one class), a run's saved config that names
    ``old.Name`` as its ``class_path`` still loads, and the warning is raised once per process.
    ``new`` is imported by name: a shim is an alias kept at the package's surface, not a dependency
    of its layer, and nothing in the package imports one (tests/unit/test_deprecated_paths.py).
    """
    warnings.warn(
        f"`{old}` moved to `{new}`; import from `{new}` (or the names from `earl_lightning`): "
        f"the old path goes in {removed_in}",
        DeprecationWarning,
        stacklevel=3,  # the importing code: the import machinery's own frames are skipped
    )
    sys.modules[old] = importlib.import_module(new)


def moved_names(
    package: str, new: str, removed_in: str, stacklevel: int = 2
) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``, a module that became a package of that name: a
    name the old module had (a public name of ``new``, its new home, that is not one of the
    package's own modules) is ``new``'s very object, with the warning of :func:`moved_module`
    raised at its first use; the package keeps it after, so the warning is raised once a name.
    ``stacklevel`` 3 for a package ``__getattr__`` that calls this one.
    """

    def __getattr__(name: str) -> object:
        module = sys.modules[package]
        own = {m.name for m in pkgutil.iter_modules(module.__path__)}
        home = None if name.startswith("_") or name in own else importlib.import_module(new)
        if home is None or not hasattr(home, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(
            f"`{package}.{name}` moved to `{new}.{name}`; import it from `{new}`: "
            f"the old path goes in {removed_in}",
            DeprecationWarning,
            stacklevel=stacklevel,  # the importing code (the import machinery's frames are skipped)
        )
        value = getattr(home, name)
        setattr(module, name, value)
        return value

    return __getattr__

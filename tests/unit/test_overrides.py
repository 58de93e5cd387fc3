"""Every Lightning hook or method the package's strategies, callbacks, modules and data modules
override says so with ``@override`` (typing_extensions; ``typing.override`` needs Python 3.12):
a reader sees which methods Lightning calls, and a type checker flags one whose name or signature
drifts from Lightning's (a renamed hook is otherwise a silently dead method)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import lightning.pytorch as pl

# the packages and modules whose classes are checked
SCOPE = (
    "earl_lightning.strategies",
    "earl_lightning.callbacks",
    "earl_lightning.modules",
    "earl_lightning.sft",
    "earl_lightning.modules.datamodule",
)


def _in_scope(module: str) -> bool:
    return any(module == s or module.startswith(s + ".") for s in SCOPE)


def _classes() -> list[type]:
    """The classes defined in SCOPE that derive from a Lightning class."""
    modules = []
    for name in SCOPE:
        module = importlib.import_module(name)
        modules.append(module)
        for info in pkgutil.iter_modules(getattr(module, "__path__", []), name + "."):
            modules.append(importlib.import_module(info.name))
    found = {
        cls
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if _in_scope(cls.__module__) and any(_is_lightning(b) for b in cls.__mro__)
    }
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _is_lightning(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning")


def _function(attr: object) -> object:
    """The function under a property, staticmethod or classmethod (where @override sets its flag)."""
    if isinstance(attr, property):
        return attr.fget
    return getattr(attr, "__func__", attr)


def _overrides(cls: type) -> list[tuple[str, object]]:
    """(where, function) of each method that ``cls`` or a mixin of SCOPE defines over a method of
    a class outside the package (Lightning's, and what Lightning's classes derive from)."""
    outside = [b for b in cls.__mro__ if b is not object and not b.__module__.startswith("earl_")]
    out = []
    for own in cls.__mro__:
        if not _in_scope(own.__module__):
            continue
        for name, attr in vars(own).items():
            fn = _function(attr)
            if name.startswith("__") or not callable(fn):
                continue
            if any(name in vars(base) for base in outside):
                out.append((f"{own.__module__}.{own.__qualname__}.{name}", fn))
    return out


def test_every_overridden_lightning_method_says_override():
    classes = _classes()
    missing = sorted(
        {
            where
            for cls in classes
            for where, fn in _overrides(cls)
            if not getattr(fn, "__override__", False)
        }
    )
    assert not missing, "add @override (typing_extensions) to:\n" + "\n".join(missing)


def test_the_walk_sees_the_hooks():
    """The check is not vacuous: the public classes are walked and their known hooks are found."""
    from earl_lightning import (
        AdaptiveParallelism,
        AgenticRLModule,
        DemonstrationDataModule,
        EarlStrategy,
        EpisodeDataModule,
        StepProgressBar,
        WarmStartModule,
    )

    classes = _classes()
    for cls in (AgenticRLModule, WarmStartModule, EpisodeDataModule, DemonstrationDataModule):
        assert cls in classes
    assert issubclass(EarlStrategy, pl.strategies.Strategy) and EarlStrategy in classes
    found = {where.rsplit(".", 1)[1] for cls in classes for where, _ in _overrides(cls)}
    assert {
        "training_step",
        "validation_step",  # from the EvaluationHooks mixin
        "configure_model",
        "train_dataloader",
        "setup_environment",
        "distributed_sampler_kwargs",  # a property
        "barrier",  # from the OneLineCollectives mixin
        "state_dict",
        "train_description",
    } <= found
    assert AdaptiveParallelism in classes and StepProgressBar in classes

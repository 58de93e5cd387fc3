"""Name -> object registries whose lookups fail with the list of valid names, and accept import paths.

Every plug-in point (advantage estimators, policy losses, aggregations, KL estimators,
environments) is one :class:`Registry`. A config names an entry either by its registered name
(``grpo``) or by an import path (``my_package.losses.my_loss``): the path's module is imported (so
its ``@REGISTRY.register(...)`` decorators run) and the attribute is returned as the registry
entry it was registered as, or, when it was never registered, passed through the registry's
``adapt`` function (e.g. a plain function becomes an estimator with default properties). A bad
name or path fails at config time with a message that names the config argument, the value and
the valid choices, or the import error.

This module sits below every layer: it imports nothing from the project.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (e.g. ``"policy losses"``).

    ``adapt(obj, arg)`` turns an object reached by import path that was never registered into an
    entry (default: the object itself); it raises ValueError naming ``arg`` when it cannot.
    """

    def __init__(self, kind: str, adapt: Callable[[Any, str], T] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._registered_as: dict[int, str] = {}  # id(decorated object) -> name
        self._adapt = adapt

    def register(self, name: str, entry: Callable[[Any], T] | None = None) -> Callable[[Any], Any]:
        """Decorator: ``@REG.register("name")`` registers the decorated object; with ``entry``, it
        registers ``entry(obj)`` and still returns ``obj`` unchanged. Re-registering a name is an
        error, so two modules cannot silently shadow each other's variant."""

        def deco(obj: Any) -> Any:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = entry(obj) if entry is not None else obj
            self._registered_as[id(obj)] = name
            return obj

        return deco

    def get(self, name: str, arg: str) -> T:
        """The entry registered as ``name``, or the object at the import path ``name``; ``arg`` is
        the config argument the name came from (it is named in every error)."""
        if isinstance(name, str) and name in self._items:
            return self._items[name]
        if not isinstance(name, str) or "." not in name:
            raise ValueError(
                f"unknown `{arg}` {name!r}; valid {self.kind}: {self.names()}, "
                f"or an import path such as `my_package.module.Name`"
            )
        obj = import_object(name, arg)
        registered = self._registered_as.get(id(obj))
        if registered is not None:
            return self._items[registered]
        return self._adapt(obj, arg) if self._adapt is not None else obj

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def import_object(path: str, arg: str) -> Any:
    """The object at ``package.module.Name``; errors name ``arg``, the path and the import error."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"`{arg}` {path!r} is not an import path of the form `package.module.Name`"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure while importing the user's module is reported as such
        hint = ""
        if isinstance(err, ModuleNotFoundError) and module_name.startswith(str(err.name)):
            here = os.getcwd()
            hint = (
                f" (not in the working directory {here!r}, the installed packages or PYTHONPATH)"
                if here in sys.path or "" in sys.path
                else f" (the working directory {here!r} is not on Python's path: add the module's "
                f"directory to PYTHONPATH)"
            )
        raise ValueError(
            f"`{arg}` {path!r}: cannot import module {module_name!r}: {type(err).__name__}: "
            f"{err}{hint}"
        ) from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(
            f"`{arg}` {path!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None


def bind_params(
    fn: Callable[..., Any], params: Mapping[str, Any], *, what: str, arg: str, skip: int = 0
) -> dict[str, Any]:
    """The keyword arguments ``params`` (None values dropped: "the function's own default")
    checked against ``fn``'s signature, so a setting that ``fn`` does not take fails at config
    time. ``skip``: leading positional parameters the caller fills in (tensors). ``what`` names
    ``fn`` in errors (``"policy loss 'gspo'"``); ``arg`` is the config group (``--model.algorithm.loss``)."""
    given = {k: v for k, v in params.items() if v is not None}
    sig = inspect.signature(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return given
    accepted = [
        p.name
        for p in list(sig.parameters.values())[skip:]
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    bad = sorted(set(given) - set(accepted))
    if bad:
        raise ValueError(
            f"`{arg}.{bad[0]}` ({given[bad[0]]!r}) does not apply to {what}; its parameters: "
            f"{accepted}. Leave it unset (null) or pick an entry that takes it"
        )
    return given


def param_default(
    fn: Callable[..., Any], name: str, given: Mapping[str, Any], fallback: Any
) -> Any:
    """The value ``fn`` will see for parameter ``name``: the given one, else its signature default,
    else ``fallback`` (``fn`` does not take it)."""
    if given.get(name) is not None:
        return given[name]
    p = inspect.signature(fn).parameters.get(name)
    return fallback if p is None or p.default is inspect.Parameter.empty else p.default

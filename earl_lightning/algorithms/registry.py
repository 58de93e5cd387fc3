"""A name -> object registry whose lookups fail with the list of valid names.

Every algorithm variant (advantage estimator, policy loss, aggregation, KL estimator) is looked up by
the name a user wrote in a config, so a typo must fail at config-construction time with a message
that names the config argument, the bad value and the valid choices.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (e.g. ``"policy losses"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("name")``. Re-registering a name is an error, so two modules
        cannot silently shadow each other's variant."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str, arg: str) -> T:
        """The object registered as ``name``; ``arg`` is the config argument the name came from."""
        if not isinstance(name, str) or name not in self._items:
            raise ValueError(f"unknown `{arg}` {name!r}; valid {self.kind}: {self.names()}")
        return self._items[name]

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

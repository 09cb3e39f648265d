"""A string-keyed registry that fails loudly: one source of truth per choice."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from osworld_jax.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to implementations; duplicate registrations and unknown look-ups raise.

    Attributes:
      kind: what the registry holds, used in error messages (e.g. "advantage estimator").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; a duplicate name raises ``ValueError``."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        """Registers ``obj`` under ``name``; raises ``ValueError`` on a duplicate."""
        if name in self._items:
            raise ValueError(f"duplicate {self.kind} name {name!r}")
        self._items[name] = obj

    def get(self, name: str) -> T:
        """Returns the entry for ``name``; an unknown name raises ``ConfigError``."""
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose one of {sorted(self._items)}"
            ) from None

    def validate(self, name: str, field: str) -> None:
        """Raises ``ConfigError`` naming ``field`` when ``name`` is not registered."""
        if name not in self._items:
            raise ConfigError(
                f"{field}: unknown {self.kind} {name!r}; choose one of {self.names()}"
            )

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

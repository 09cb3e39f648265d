"""Picking one of N, written one way: `Registry` for implementations, `Literal` for values.

A choice with implementations (estimators, gates, backends) lives in a `Registry` that fails
loudly; a plain choice is a ``Literal[...]`` type alias on the config field, validated by
`check_choice` (and by the gin binding's type check).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

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


def check_choice(value: object, choices: Any, field: str, kind: str = "value") -> None:
    """Raises ``ConfigError`` naming ``field`` unless ``value`` is one of a ``Literal``'s values.

    Args:
      value: the configured value.
      choices: a ``Literal[...]`` type (e.g. ``GateLevel``).
      field: ``Class.field`` for the message.
      kind: what the choice is (``"gate level"``), for the message.

    >>> check_choice("token", typing.Literal["sequence", "token"], "LossConfig.gate_level")
    """
    allowed = _choices(choices)
    if value not in allowed:
        raise ConfigError(f"{field}: unknown {kind} {value!r}; choose one of {list(allowed)}")


def _choices(choices: Any) -> tuple[Any, ...]:
    """The values of a ``Literal`` (or of a union of ``Literal``s and ``None``)."""
    if choices is type(None):
        return (None,)
    if typing.get_origin(choices) is typing.Literal:
        return typing.get_args(choices)
    return tuple(v for arg in typing.get_args(choices) for v in _choices(arg))

"""Which sandbox backends exist, and `make_backend` (no jax).

``BACKENDS`` maps a backend's name to its ``SandboxBackend`` class. The built-in backends are
listed below by import path and imported on first use, so naming a backend costs nothing until
it is built (``osworld`` needs upstream ``desktop_env`` only when it runs). Everything that picks
a backend by name or by config reads this one table: ``AgentEnvConfig.backend`` validation,
``capabilities``, the gin registration of backend configs (``config_classes``) and
``make_backend``.

Adding a backend (see docs/DESIGN.md): write one module with a ``SandboxBackend`` subclass
(``name``, ``sandbox_type``, ``config_class`` if its constructor takes a config dataclass,
``runs_on_host`` if its desktops run on this machine; a sandbox on the in-VM protocol subclasses
``VMSandbox``) and add its line to ``BUILTIN_BACKENDS``. Test code may ``BACKENDS.add(name, cls)``
its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from osworld_jax.env.backend import SandboxBackend
from osworld_jax.errors import ConfigError
from osworld_jax.registry import Registry

__all__ = ["BACKENDS", "BUILTIN_BACKENDS", "BackendRegistry", "make_backend"]

#: name -> "module:Class" of every built-in backend (the one registry entry per backend).
BUILTIN_BACKENDS: Mapping[str, str] = {
    "local": "osworld_jax.env.local.backend:LocalBackend",
    "remote": "osworld_jax.env.remote.backend:RemoteBackend",
    "osworld": "osworld_jax.env.osworld_adapter:OSWorldBackend",
    "memory": "osworld_jax.testing.memory:MemoryBackend",
}

BackendClass = type[SandboxBackend[Any]]


class BackendRegistry(Registry[BackendClass]):
    """A ``Registry`` of backend classes whose built-in entries are imported on first use.

    ``get``, ``validate``, ``names``, ``in`` and iteration see the lazy entries as registered;
    ``add``/``register`` add eager ones (tests' backends); a duplicate name raises.
    """

    def __init__(self, kind: str, lazy: Mapping[str, str]) -> None:
        super().__init__(kind)
        self._lazy = dict(lazy)

    def add(self, name: str, obj: BackendClass) -> None:
        """Registers ``obj`` under ``name``; a name taken (also by a built-in) raises."""
        if name in self._lazy:
            raise ValueError(f"duplicate {self.kind} name {name!r}")
        super().add(name, obj)

    def get(self, name: str) -> BackendClass:
        """The backend class of ``name`` (importing a built-in one); unknown names raise."""
        if name in self._lazy and name not in self._items:
            self._items[name] = _load(name, self._lazy[name])
        return super().get(name)

    def validate(self, name: str, field: str) -> None:
        """Raises ``ConfigError`` naming ``field`` when no backend is called ``name``."""
        if name not in self:
            raise ConfigError(
                f"{field}: unknown {self.kind} {name!r}; choose one of {self.names()}"
            )

    def names(self) -> list[str]:
        """Every backend name (built-in and added), sorted."""
        return sorted({*self._items, *self._lazy})

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def config_classes(self) -> tuple[type, ...]:
        """The config dataclass of every backend that takes one (imports every built-in)."""
        classes = (self.get(n).config_class for n in self.names())
        return tuple(dict.fromkeys(c for c in classes if c is not None))

    def name_for_config(self, config: object) -> str:
        """The name of the backend whose ``config_class`` ``config`` is an instance of."""
        for name in self.names():
            cls = self.get(name).config_class
            if cls is not None and type(config) is cls:
                return name
        raise ConfigError(
            f"no {self.kind} takes a {type(config).__name__}; the backends' configs are "
            f"{sorted(c.__name__ for c in self.config_classes())}"
        )


def _load(name: str, path: str) -> BackendClass:
    module, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, SandboxBackend)) or cls.name != name:
        raise TypeError(f"sandbox backend {name!r}: {path} is not a SandboxBackend named {name!r}")
    return cls


BACKENDS = BackendRegistry("sandbox backend", BUILTIN_BACKENDS)


def make_backend(spec: str | object, /, *args: Any, **kwargs: Any) -> SandboxBackend[Any]:
    """Builds a sandbox backend from its config or its name.

    Args:
      spec: a backend config (``LocalBackendConfig(...)``, ``RemoteBackendConfig(...)``, ...):
        the backend whose ``config_class`` it is gets it as its only argument; or a ``BACKENDS``
        name, whose class gets ``args`` and ``kwargs``.
      *args: constructor arguments when ``spec`` is a name.
      **kwargs: constructor keyword arguments when ``spec`` is a name.

    Raises:
      ConfigError: an unknown name, or a config no backend takes.
    """
    if isinstance(spec, str):
        cls: Any = BACKENDS.get(spec)  # constructors differ: a config, keywords, nothing
        return cls(*args, **kwargs)
    if args or kwargs:
        raise TypeError("make_backend(config) takes no further arguments")
    cls = BACKENDS.get(BACKENDS.name_for_config(spec))
    return cls(spec)

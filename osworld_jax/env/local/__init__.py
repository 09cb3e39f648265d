"""The ``local`` sandbox backend: jailed Xvfb desktops on this machine (no jax, no VM).

Listed as ``"local"`` in ``osworld_jax.env.backends.BACKENDS``. See
``backend.py`` (sandboxes, fork semantics), ``desktop.py`` (the bubblewrap jail) and
``vmserver.py`` (the in-VM server the jail runs with the system python3).
"""

from osworld_jax.env.local.backend import LocalBackend, LocalBackendConfig, LocalSandbox
from osworld_jax.env.local.desktop import LocalDesktop

__all__ = ["LocalBackend", "LocalBackendConfig", "LocalDesktop", "LocalSandbox"]

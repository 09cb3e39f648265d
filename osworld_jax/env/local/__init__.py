"""The ``local`` sandbox backend: jailed Xvfb desktops on this machine (no jax, no VM).

Listed as ``"local"`` in ``osworld_jax.env.backends.BACKENDS``. See
``backend.py`` (sandboxes, warm pool; beside it ``config.py``, ``sandbox.py``, ``preflight.py``,
``snapshot.py``: fork semantics), ``desktop.py`` (a running jail), ``jail.py`` (what the bubblewrap
jail is started with and guarantees), ``procfs.py`` (its processes, from ``/proc``) and
``vmserver.py`` (the in-VM server the jail runs with the system python3).
"""

from osworld_jax.env.local.backend import LocalBackend, LocalBackendConfig, LocalSandbox
from osworld_jax.env.local.desktop import LocalDesktop

__all__ = ["LocalBackend", "LocalBackendConfig", "LocalDesktop", "LocalSandbox"]

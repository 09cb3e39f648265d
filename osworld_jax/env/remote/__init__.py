"""The ``remote`` sandbox backend: OSWorld desktops in an OpenSandbox-style service (no jax).

Listed as ``"remote"`` in ``osworld_jax.env.backends.BACKENDS``. The fake service for tests and
load tests is ``osworld_jax.testing.sandbox_service``.
"""

from osworld_jax.env.remote.api import (
    RateLimiter,
    RemoteCreateError,
    RemoteServiceError,
    RemoteStepError,
    SandboxServiceClient,
)
from osworld_jax.env.remote.backend import RemoteBackend
from osworld_jax.env.remote.config import RemoteBackendConfig
from osworld_jax.env.remote.metrics import RemoteMetrics
from osworld_jax.env.remote.sandbox import RemoteSandbox
from osworld_jax.env.tls import CABundleError, check_ca_bundle, pinned_ssl_context

__all__ = [
    "CABundleError",
    "RateLimiter",
    "RemoteBackend",
    "RemoteBackendConfig",
    "RemoteCreateError",
    "RemoteMetrics",
    "RemoteSandbox",
    "RemoteServiceError",
    "RemoteStepError",
    "SandboxServiceClient",
    "check_ca_bundle",
    "pinned_ssl_context",
]

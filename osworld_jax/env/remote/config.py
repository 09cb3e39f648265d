"""Configuration of the ``remote`` sandbox backend (no jax)."""

from __future__ import annotations

import dataclasses
from typing import Literal
from urllib.parse import urlsplit

from osworld_jax.errors import ConfigError
from osworld_jax.registry import check_choice

#: ``auto``: the service's ``/fork`` when it has one, else snapshots; ``never``: snapshots.
UseFork = Literal["auto", "never"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteBackendConfig:
    """How the ``remote`` backend talks to an OpenSandbox-style sandbox service.

    The service's lifecycle API lives under ``base_url`` (OpenSandbox: ``https://HOST/v1``); each
    sandbox's OSWorld in-VM server is reached at the endpoint the service returns for
    ``vm_port``. Every connection (lifecycle and sandbox endpoints) is HTTPS verified against
    ``ca_bundle`` only: the system's CAs are never trusted.

    Attributes:
      base_url: the lifecycle API root, ``https://...`` (e.g. ``https://sandbox.example.org/v1``).
      ca_bundle: path of the PEM file holding the CA certificate(s) the service's certificate
        must chain to (the pinned CA); nothing else is trusted.
      token_env: name of the environment variable holding the API token. The token itself is
        never part of the config, never logged and redacted from errors.
      auth_header: the request header that carries the token (OpenSandbox:
        ``OPEN-SANDBOX-API-KEY``; ``Authorization`` sends ``Bearer <token>``).
      image: the image / template the service boots for an OSWorld desktop.
      entrypoint: the sandbox's entry process (OpenSandbox requires one; empty = omitted, the
        image's own).
      resource_limits: (name, value) resource limits per sandbox, e.g. ``(("cpu", "4"),)``.
      sandbox_ttl_s: the service-side lifetime of a sandbox (OpenSandbox ``timeout``): a sandbox
        this process fails to delete (a crash) expires by itself after this long.
      metadata: extra (key, value) metadata attached to every sandbox (the backend adds its own
        client tag, used to find and delete leftovers).
      vm_port: the in-VM server's port inside the sandbox (OSWorld: 5000).
      boot_timeout_s: how long a sandbox may take from creation to a ready in-VM server (VMs take
        minutes: generous by default); exceeding it raises ``SandboxTimeout``. Keep it below
        ``AgentEnvConfig.create_timeout_s``/``fork_timeout_s`` (default 600 s), which also cover
        the task's setup, so that a slow boot reports as such.
      snapshot_timeout_s: how long a snapshot may take to become ready.
      poll_interval_s: pause between status polls of a booting sandbox or pending snapshot.
      request_timeout_s: socket connect/read limit of one lifecycle API request.
      rpc_timeout_s: default deadline of one in-VM server request.
      step_timeout_s: deadline of one action's execution in the desktop.
      max_connections: cap on simultaneously open HTTPS connections of this backend (lifecycle
        and sandbox endpoints together); requests beyond it wait for a free connection.
      max_creations_per_s: sustained rate of sandbox creations (a fork of n counts n).
      creation_burst: how many creations may start at once before the rate applies.
      max_retries: retries of a lifecycle request answered 429, 5xx or by a dropped connection.
      backoff_initial_s: first retry delay (doubles per retry, with jitter) when the reply has no
        ``Retry-After``.
      backoff_max_s: upper bound of one retry delay (also caps ``Retry-After``).
      use_fork: ``auto``: use ``POST /sandboxes/{id}/fork`` when the service offers it, else fork
        by snapshot; ``never``: always fork by snapshot.
      fork_rerun_step_types: setup step types a snapshot fork re-runs (a disk snapshot keeps
        files, not running programs).
      settle_s: pause after an action before observing (lets the screen repaint).
      wait_action_s: how long a WAIT action pauses.
      observe_a11y: include the accessibility tree in observations.
      observe_terminal: include the focused terminal's text in observations.
      cache_dir: the task file cache for ``download`` steps; None = the default cache.
    """

    base_url: str
    ca_bundle: str
    token_env: str = "OPEN_SANDBOX_API_KEY"
    auth_header: str = "OPEN-SANDBOX-API-KEY"
    image: str = "osworld-ubuntu:latest"
    entrypoint: tuple[str, ...] = ()
    resource_limits: tuple[tuple[str, str], ...] = (("cpu", "4"), ("memory", "8Gi"))
    sandbox_ttl_s: int = 3600
    metadata: tuple[tuple[str, str], ...] = ()
    vm_port: int = 5000
    boot_timeout_s: float = 420.0
    snapshot_timeout_s: float = 300.0
    poll_interval_s: float = 2.0
    request_timeout_s: float = 60.0
    rpc_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    max_connections: int = 128
    max_creations_per_s: float = 4.0
    creation_burst: int = 16
    max_retries: int = 8
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    use_fork: UseFork = "auto"
    fork_rerun_step_types: tuple[str, ...] = (
        "launch",
        "open",
        "activate_window",
        "close_window",
        "sleep",
    )
    settle_s: float = 0.5
    wait_action_s: float = 1.0
    observe_a11y: bool = True
    observe_terminal: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme != "https" or not parts.hostname:
            raise ConfigError(
                f"RemoteBackendConfig.base_url must be an https:// URL, got {self.base_url!r}"
            )
        if not self.ca_bundle:
            raise ConfigError("RemoteBackendConfig.ca_bundle: a PEM CA bundle path is required")
        if not self.token_env:
            raise ConfigError("RemoteBackendConfig.token_env: an environment variable name")
        check_choice(self.use_fork, UseFork, "RemoteBackendConfig.use_fork")
        for name in (
            "boot_timeout_s",
            "snapshot_timeout_s",
            "poll_interval_s",
            "request_timeout_s",
            "rpc_timeout_s",
            "step_timeout_s",
            "max_creations_per_s",
            "backoff_initial_s",
            "backoff_max_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"RemoteBackendConfig.{name} must be > 0")
        for name in ("max_connections", "creation_burst"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RemoteBackendConfig.{name} must be >= 1")
        if self.max_retries < 0:
            raise ConfigError("RemoteBackendConfig.max_retries must be >= 0")
        if not 1 <= self.vm_port <= 65535:
            raise ConfigError(f"RemoteBackendConfig.vm_port out of range: {self.vm_port}")
        if self.settle_s < 0 or self.wait_action_s < 0:
            raise ConfigError("RemoteBackendConfig.settle_s/wait_action_s must be >= 0")

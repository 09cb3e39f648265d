"""Shared exception bases: every room's typed errors derive from these."""


class OsworldJaxError(Exception):
    """Base of every error osworld_jax raises on purpose."""


class ConfigError(OsworldJaxError, ValueError):
    """A configuration value, file or binding is wrong (the message names it)."""


class InfraError(OsworldJaxError):
    """An infrastructure failure (sandbox, server, timeout): the owner is masked, not trained on."""


class PreflightError(ConfigError):
    """A part of a run cannot work here (a sandbox backend, a server, the model, the tasks).

    Raised before anything starts; the message names each problem, one per line.
    """

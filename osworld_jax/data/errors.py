"""Typed errors of the data room."""

from osworld_jax.errors import ConfigError, OsworldJaxError


class DataError(OsworldJaxError, ValueError):
    """A task set is missing, empty or malformed (the message names the file)."""


class TaskSetEmptyError(DataError, ConfigError):
    """A task set resolved to zero tasks."""


class FreezeError(DataError):
    """The DAPO-band freezer refused (inputs changed, output exists, bad calibration line)."""

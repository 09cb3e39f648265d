"""Typed errors of the model room."""

from osworld_jax.errors import ConfigError, OsworldJaxError


class ModelConfigError(ConfigError):
    """A model config value is unsupported or missing (the message names the key)."""


class RouterReplayError(OsworldJaxError, ValueError):
    """A replayed expert route is corrupt (partly negative, out of range or duplicated)."""


class CheckpointError(OsworldJaxError, ValueError):
    """An HF checkpoint on disk is malformed: missing files or tensors, wrong shapes."""


class ImageInputError(OsworldJaxError, ValueError):
    """An image given to the `ImageProcessor` cannot be used (undecodable, wrong shape/dtype)."""


class ChatTemplateError(ConfigError):
    """A chat template is missing, does not compile, or renders inconsistently."""

"""osworld_jax: a JAX RL stack that trains computer-use agents on OSWorld desktop tasks."""

__version__ = "0.1.0"

"""osworld_jax.agent room (see docs/INTERFACES.md)."""

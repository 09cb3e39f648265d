"""osworld_jax.data room (see docs/INTERFACES.md)."""

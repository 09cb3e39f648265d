"""osworld_jax.algorithms room (see docs/INTERFACES.md)."""

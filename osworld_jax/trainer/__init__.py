"""osworld_jax.trainer room (see docs/INTERFACES.md)."""

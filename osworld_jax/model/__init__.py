"""osworld_jax.model room (see docs/INTERFACES.md)."""

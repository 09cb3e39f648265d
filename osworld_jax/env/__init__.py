"""osworld_jax.env room (see docs/INTERFACES.md)."""

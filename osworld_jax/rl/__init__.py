"""osworld_jax.rl room (see docs/INTERFACES.md)."""

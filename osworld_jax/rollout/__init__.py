"""osworld_jax.rollout room (see docs/INTERFACES.md)."""

"""The learnable suite, now the learning demo's (`osworld_jax.demo.learnable`); re-exported."""

from osworld_jax.demo.learnable import (
    BACKEND,
    BINDINGS,
    STEPS,
    VOWELS,
    VowelBackend,
    VowelSandbox,
    vowel_reward,
    write_tasks,
)

__all__ = [
    "BACKEND",
    "BINDINGS",
    "STEPS",
    "VOWELS",
    "VowelBackend",
    "VowelSandbox",
    "vowel_reward",
    "write_tasks",
]

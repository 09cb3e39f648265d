"""Rematerialisation (gradient checkpointing) policies for one decoder layer, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from osworld_jax.registry import Registry

# name -> jax.checkpoint policy (None = no remat at all).
REMAT_POLICIES: Registry[Any] = Registry("remat policy")
REMAT_POLICIES.add("none", None)
REMAT_POLICIES.add("full", jax.checkpoint_policies.nothing_saveable)
REMAT_POLICIES.add("dots", jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
REMAT_POLICIES.add("dots_with_batch", jax.checkpoint_policies.dots_saveable)


def apply_remat(fn: Callable, name: str) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy ("none": unchanged)."""
    policy = REMAT_POLICIES.get(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=policy)

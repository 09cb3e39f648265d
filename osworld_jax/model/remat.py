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


def _dots_and_attention(prim: Any, *avals: Any, **params: Any) -> bool:
    """``dots`` plus the outputs of cuDNN's fused attention forward (output and softmax stats).

    The kernel is a custom call, not a dot: under ``dots`` the backward runs it again to get
    its residuals. Saving them costs ``[N, heads, D]`` + f32 ``[heads, N]`` per block.
    """
    if prim.name.startswith("dot_product_attention_fwd"):
        return True
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


REMAT_POLICIES.add("dots_attention", _dots_and_attention)


def apply_remat(fn: Callable, name: str) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy ("none": unchanged)."""
    policy = REMAT_POLICIES.get(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=policy)

"""A bitwise digest of a parameter tree, computed on the device (the refit's exactness check).

The trainer digests its cast of the new weights, the server what it serves after the refit; the
two strings agree iff every tensor has the same name, shape, dtype and bits (up to a 32-bit hash
per tensor). Reading the tree once on the device costs ~1 ms per GB on a GPU: cheap beside any
refit, so it runs on every one.

Per tensor ``x`` with bits ``b_i`` (its elements bitcast to unsigned integers, flattened) and
position ``i``::

    h_i = mix((b_i + i * 0x9E3779B1) * 0x85EBCA6B),  mix(h) = h ^ (h >> 15)
    digest(x) = sum_i h_i  (mod 2^32)

so a changed element, a swapped pair or a transposed tensor changes it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from osworld_jax.contract.refit import join_digests

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_digest(x: jax.Array) -> jax.Array:
    """u32[] digest of one tensor's bits (see the module doc)."""
    width = jnp.dtype(x.dtype).itemsize
    if width not in _UNSIGNED:  # 8-byte tensors: hash both halves
        x = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        width = 4
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[width]).reshape(-1).astype(jnp.uint32)
    i = jax.lax.iota(jnp.uint32, bits.shape[0])  # wraps past 2^32 elements: still a hash
    h = (bits + i * jnp.uint32(0x9E3779B1)) * jnp.uint32(0x85EBCA6B)
    return jnp.sum(h ^ (h >> 15), dtype=jnp.uint32)


@functools.cache
def _digest_fn() -> Any:
    return jax.jit(lambda tree: jax.tree.map(_leaf_digest, tree))


def params_digest(params: Any) -> str:
    """The digest string of a parameter tree (`osworld_jax.contract.refit.join_digests`).

    Tensors are named by their tree path and taken in the tree's order, so two trees agree
    only if their structure does too. Shapes and dtypes enter through the names' list and the
    bits (a reshaped tensor with the same bits hashes alike: the refit checks shapes itself).
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    digests = jax.device_get(_digest_fn()(params))
    values = jax.tree.leaves(digests)
    names = [f"{jax.tree_util.keystr(path)}:{np.dtype(leaf.dtype).name}" for path, leaf in leaves]
    return join_digests([(n, int(v)) for n, v in zip(names, values, strict=True)])

"""Where the train state's leaves live and in which dtype (the `Trainer`'s layout helpers)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

Params = Any  # nested dict {group: {name: array}}


def master_dtype_of(dtype: Any, master: str | None) -> Any:
    """The train-state dtype of a parameter of ``dtype`` (floating parameters only)."""
    if master is None or not jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return jnp.dtype(master)


def follow_params(opt_state: Any, param_shardings: Params, default: NamedSharding) -> Any:
    """Shardings for an optax state: parameter-shaped leaves follow their parameter.

    A leaf whose key path ends with a parameter's key path (Adam's ``mu``/``nu``) gets that
    parameter's sharding; everything else (counts, ...) is replicated.
    """
    by_path = {
        tuple(path): sh for path, sh in jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    }
    depth = max(len(p) for p in by_path)

    def pick(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        for k in range(min(depth, len(path)), 0, -1):
            sh = by_path.get(tuple(path[-k:]))
            if sh is not None and len(sh.spec) <= leaf.ndim:
                return sh
        return default

    return jax.tree_util.tree_map_with_path(pick, opt_state)

"""Frozen-router support: label the router weights so an optimizer can leave them fixed.

NeMo RL's OSWorld recipes freeze the MoE router. Use with ``optax.multi_transform``::

    labels = router_param_labels(params, freeze_router=True)
    tx = optax.multi_transform({"trainable": adamw, "frozen": optax.set_to_zero()}, labels)
"""

from __future__ import annotations

from typing import Any

import jax

ROUTER_PARAM = "router"


def is_router_path(path: tuple[Any, ...]) -> bool:
    """True when a pytree key path points at a router weight (``moe.router``)."""
    for k in path:
        name = getattr(k, "key", getattr(k, "name", None))
        if name == ROUTER_PARAM:
            return True
    return False


def router_param_labels(params: Any, *, freeze_router: bool) -> Any:
    """A tree like ``params`` of "frozen" (router weights, when frozen) / "trainable" labels.

    Works on `Policy.params()` dicts and on ``nnx.State`` trees alike.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if freeze_router and is_router_path(path) else "trainable",
        params,
    )

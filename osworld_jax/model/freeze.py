"""Frozen parameters: label the router (and/or the vision tower) so an optimizer leaves them fixed.

NeMo RL's OSWorld recipes freeze the MoE router; many vision-language RL recipes also freeze the
vision tower (the ViT, its merger and the DeepStack mergers). Use with ``optax.multi_transform``::

    labels = param_labels(params, freeze_router=True, freeze_vision=True)
    tx = optax.multi_transform({"trainable": adamw, "frozen": optax.set_to_zero()}, labels)
"""

from __future__ import annotations

from typing import Any

import jax

ROUTER_PARAM = "router"
VISION_GROUPS = ("vision", "vision_blocks", "deepstack")


def _names(path: tuple[Any, ...]) -> list[Any]:
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_router_path(path: tuple[Any, ...]) -> bool:
    """True when a pytree key path points at a router weight (``moe.router``)."""
    return ROUTER_PARAM in _names(path)


def is_vision_path(path: tuple[Any, ...]) -> bool:
    """True when a pytree key path points into the vision tower (groups `VISION_GROUPS`)."""
    return any(name in VISION_GROUPS for name in _names(path))


def param_labels(params: Any, *, freeze_router: bool = False, freeze_vision: bool = False) -> Any:
    """A tree like ``params`` of "frozen" / "trainable" labels.

    Works on `Policy.params()` dicts and on ``nnx.State`` trees alike; a text model has no
    vision leaves, so ``freeze_vision`` changes nothing there.
    """

    def label(path: tuple[Any, ...], _: Any) -> str:
        frozen = (freeze_router and is_router_path(path)) or (
            freeze_vision and is_vision_path(path)
        )
        return "frozen" if frozen else "trainable"

    return jax.tree_util.tree_map_with_path(label, params)


def router_param_labels(params: Any, *, freeze_router: bool) -> Any:
    """`param_labels` with the router alone (kept for callers of the router-only labels)."""
    return param_labels(params, freeze_router=freeze_router)

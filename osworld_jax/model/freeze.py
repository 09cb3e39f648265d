"""Frozen parameters: label the router (and/or the vision tower) so the trainer leaves them fixed.

The seed's recipes freeze the MoE router (so R3's replayed routes stay the routes the router
would pick across steps) and the vision tower with its projection (``freeze_vision_model`` +
``freeze_vision_projection``: here the ViT blocks, the patch embedding, the merger and the
DeepStack mergers, one switch). Qwen3-VL-MoE's router is one matrix per MoE layer with no
auxiliary-loss-free bias, so the seed's "router bias-update rate 0" has nothing to act on here.

The trainer (``osworld_jax.trainer``) makes a frozen parameter cost only its one copy: it is
held in the policy's dtype (no float32 master), ``jax.grad`` is not taken with respect to it
(the step differentiates the trainable partition only), the optimizer keeps no state for it
(``optax.multi_transform`` with ``set_to_zero``), and the step returns it unchanged, bit for
bit::

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


def is_frozen_name(name: str, *, freeze_router: bool, freeze_vision: bool) -> bool:
    """True when a ``"group.name"`` parameter (`osworld_jax.model.params.param_specs`) is frozen."""
    group, _, leaf = name.partition(".")
    return (freeze_router and leaf == ROUTER_PARAM) or (freeze_vision and group in VISION_GROUPS)


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

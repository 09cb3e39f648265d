"""Sharding: logical parameter axes -> mesh axes (``data``, ``fsdp``, ``expert``, ``tensor``).

One `ShardingRules` object maps each logical axis name of `params.LOGICAL_AXES` to a tuple of
mesh axes. A mesh axis that does not divide a dimension (or is already used by an earlier
dimension of the same array) is dropped for that array, so any config shards correctly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.errors import ModelConfigError
from osworld_jax.model.params import LOGICAL_AXES, param_specs

MESH_AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """Logical axis -> mesh axes.

    Attributes:
      rules: ``(logical_axis, (mesh_axis, ...))`` pairs; axes not listed are replicated. The
        default shards embed dims over ``fsdp``, heads / MLP widths / vocab over ``tensor`` and
        experts over ``expert``; activations' batch over ``data`` + ``fsdp`` + ``expert``. The
        ViT follows the same scheme (``vision_embed`` over ``fsdp``, ``vision_heads`` and
        ``vision_mlp`` over ``tensor``); its activations (per-row pixels) split like the batch.
      batch_axes: mesh axes the batch (row) dimension of activations is split over.
    """

    rules: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("vocab", ("tensor",)),
        ("embed", ("fsdp",)),
        ("q_heads", ("tensor",)),
        ("kv_heads", ("tensor",)),
        ("mlp", ("tensor",)),
        ("expert_mlp", ("tensor",)),
        ("experts", ("expert",)),
        ("vision_embed", ("fsdp",)),
        ("vision_heads", ("tensor",)),
        ("vision_mlp", ("tensor",)),
    )
    batch_axes: tuple[str, ...] = ("data", "fsdp", "expert")

    def __post_init__(self) -> None:
        for logical, mesh_axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise ModelConfigError(
                    f"ShardingRules.rules: unknown logical axis {logical!r}; known: {LOGICAL_AXES}"
                )
            bad = [a for a in mesh_axes if a not in MESH_AXES]
            if bad:
                raise ModelConfigError(f"ShardingRules.rules[{logical!r}]: unknown mesh axes {bad}")

    def spec(
        self, axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh
    ) -> PartitionSpec:
        """The PartitionSpec of an array with these logical ``axes`` and ``shape`` on ``mesh``."""
        table = dict(self.rules)
        used: set[str] = set()
        out: list[tuple[str, ...] | None] = []
        for name, dim in zip(axes, shape, strict=True):
            chosen: list[str] = []
            for a in table.get(name, ()) if name else ():
                size = math.prod(mesh.shape[x] for x in chosen) * mesh.shape.get(a, 1)
                if a in used or a not in mesh.shape or dim % size:
                    continue
                chosen.append(a)
            used.update(chosen)
            out.append(tuple(chosen) if chosen else None)
        return PartitionSpec(*out)

    def batch_spec(self, batch: int, mesh: Mesh, ndim: int) -> PartitionSpec:
        """Spec for an activation/batch array [B, ...] of rank ``ndim`` (rows split)."""
        axes = tuple(a for a in self.batch_axes if a in mesh.shape)
        if batch % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        return PartitionSpec(axes or None, *([None] * (ndim - 1)))


def make_mesh(
    data: int = 1,
    fsdp: int = 1,
    expert: int = 1,
    tensor: int = 1,
    devices: list | None = None,
) -> Mesh:
    """A Mesh with axes (data, fsdp, expert, tensor) over the first product-many devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * fsdp * expert * tensor
    if n > len(devices):
        raise ModelConfigError(
            f"make_mesh: {data}x{fsdp}x{expert}x{tensor} = {n} > {len(devices)} devices"
        )
    grid = np.asarray(devices[:n], dtype=object).reshape(data, fsdp, expert, tensor)
    return Mesh(grid, MESH_AXES)


def param_shardings(
    config: Qwen3MoeConfig, mesh: Mesh, rules: ShardingRules | None = None
) -> dict[str, dict[str, NamedSharding]]:
    """NamedShardings shaped like `Policy.params()`: ``{group: {name: NamedSharding}}``."""
    rules = rules or ShardingRules()
    out: dict[str, dict[str, NamedSharding]] = {}
    for key, spec in param_specs(config).items():
        group, name = key.split(".")
        out.setdefault(group, {})[name] = NamedSharding(
            mesh, rules.spec(spec.axes, spec.shape, mesh)
        )
    return out


def policy_shardings(policy, mesh: Mesh, rules: ShardingRules | None = None):
    """An ``nnx.State``-shaped tree of NamedShardings for ``nnx.state(policy)``.

    Reads each Param's ``logical_axes`` metadata; use with ``jax.device_put`` or as jit
    ``out_shardings`` (e.g. ``nnx.state(policy)`` -> sharded state -> ``nnx.update``).
    """
    from flax import nnx

    rules = rules or ShardingRules()
    state = nnx.state(policy, nnx.Param)
    return jax.tree.map(
        lambda v: NamedSharding(mesh, rules.spec(v.get_metadata()["logical_axes"], v.shape, mesh)),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )

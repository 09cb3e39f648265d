"""Expert parallelism on the ``expert`` mesh axis: each device computes only its own experts.

With ``n = mesh.shape["expert"] > 1`` the expert weights ``[E, H, I]`` are split over ``expert``
(device ``r`` holds experts ``[r E/n, (r + 1) E/n)``, the `ShardingRules` default) and the
batch rows over ``data x fsdp x expert``. One MoE layer then runs, inside a ``shard_map``:

1. **dispatch** (all-gather over ``expert``): every device of an expert group receives the
   ``T_loc`` routed tokens of the others, ``x [n T_loc, H]`` with their routes ``[n T_loc, K]``
   and gate weights (routing ran before, on the device's own tokens, so R3's replayed ids
   decide the dispatch unchanged);
2. **local experts**: the (token, k) slots routed to another device's experts are set to
   ``-1`` (not computed: every backend skips them) and the grouped GEMMs of the configured
   backend run on the ``E/n`` local experts only, giving a partial ``y [n T_loc, H]``;
3. **combine** (reduce-scatter over ``expert``): the partial outputs are summed over the
   group and each device keeps its own ``T_loc`` rows. With the expert MLP width split over
   ``tensor`` the partial sums are also summed over ``tensor`` (Megatron-style expert TP).

No token is dropped and every shape is static: a device's buffer holds the worst case, all
``n T_loc`` tokens routed to its experts (``min(K, E/n)`` slots per token); the Pallas kernels
skip its unused tiles, so compute follows the real load and only memory is sized for the
worst case. The backward is the transpose: the gradient of the dispatch all-gather is a
reduce-scatter, that of the combine an all-gather, and the expert-weight gradients stay on
their devices (summed over ``data``/``fsdp`` only, where the rows differ). With ``fsdp > 1``
the local experts' embed dim is split over ``fsdp`` as the parameters are: gathered inside
the layer, their gradients reduce-scattered back (explicit, so never an all-reduce).

Bytes per MoE layer and device (forward; the backward moves the same again), with ``b`` the
activation bytes per element: all-gather ``(n - 1) T_loc H b`` in, reduce-scatter
``(n - 1) T_loc H b`` out. An all-to-all of the routed copies instead would move
``T_loc K (n - 1)/n H b`` each way: for ``K >= n`` (top-8 routing on up to 8 devices) the
all-gather moves no more bytes, runs on every backend (``jax.lax.ragged_all_to_all`` has no
CPU lowering in jax 0.10) and needs no count exchange (this is Megatron-Core's "allgather"
token dispatcher). ``benchmarks/comm_volume.py`` prints both per mesh preset.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from osworld_jax.model.errors import ModelConfigError

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
FSDP_AXIS = "fsdp"
BATCH_AXES = ("data", "fsdp", "expert")


def _free_axes(mesh: jax.sharding.AbstractMesh) -> dict[str, int]:
    """The ambient mesh's axes that are not already manual (outside any shard_map)."""
    if mesh.empty:
        return {}
    return {a: mesh.shape[a] for a in mesh.axis_names if a not in mesh.manual_axes}


def inside_expert_parallel() -> bool:
    """Whether this trace runs inside the expert-parallel ``shard_map`` (one device's experts)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and EXPERT_AXIS in mesh.manual_axes and mesh.shape[EXPERT_AXIS] > 1


def expert_parallel_size() -> int:
    """The ambient mesh's ``expert`` axis size (1 without a mesh or that axis)."""
    return _free_axes(jax.sharding.get_abstract_mesh()).get(EXPERT_AXIS, 1)


def expert_parallel(
    expert_fn: Callable[..., jax.Array],
    x: Float[Array, "T H"],
    experts: Int[Array, "T K"],
    weights: Float[Array, "T K"],
    gate: Float[Array, "E H I"],
    up: Float[Array, "E H I"],
    down: Float[Array, "E I H"],
) -> Float[Array, "T H"]:
    """``y_t = sum_k w_tk expert_{e_tk}(x_t)`` with each expert computed on its own device.

    Runs under an ambient mesh (``jax.set_mesh``) whose ``expert`` axis is > 1 (see the module
    docstring); ``expert_fn`` is an `EXPERT_BACKENDS` function, called per device on its
    ``E / n`` local experts with the other slots set to ``-1``. Rows split over the mesh's
    batch axes (data, fsdp, expert) when they divide ``T``; otherwise (e.g. one decode row)
    every device holds all tokens, computes its experts' share and the shares are summed.

    Raises:
      ModelConfigError: ``E`` is not a multiple of the ``expert`` axis size.
    """
    mesh = jax.sharding.get_abstract_mesh()
    free = _free_axes(mesh)
    n = free.get(EXPERT_AXIS, 1)
    num_experts, _, width = gate.shape
    if num_experts % n:
        raise ModelConfigError(
            f"expert parallelism: num_experts {num_experts} is not a multiple of the mesh's "
            f"'expert' axis ({n})"
        )
    batch = tuple(a for a in BATCH_AXES if free.get(a, 1) > 1)
    if x.shape[0] % math.prod(free[a] for a in batch):
        batch = ()  # rows replicated: every device holds every token
    tp = free.get(TENSOR_AXIS, 1)
    tensor = TENSOR_AXIS if tp > 1 and width % tp == 0 else None
    fs = free.get(FSDP_AXIS, 1)
    fsdp = FSDP_AXIS if fs > 1 and gate.shape[1] % fs == 0 else None
    rows = PartitionSpec(batch or None)
    body = functools.partial(
        _local, expert_fn, gathered=EXPERT_AXIS in batch, tensor=tensor, fsdp=fsdp
    )
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            rows,
            rows,
            rows,
            PartitionSpec(EXPERT_AXIS, fsdp, tensor),
            PartitionSpec(EXPERT_AXIS, fsdp, tensor),
            PartitionSpec(EXPERT_AXIS, tensor, fsdp),
        ),
        out_specs=rows,
        axis_names=frozenset(free),
        check_vma=False,  # pallas_call outputs carry no varying-axes annotation
    )(x, experts, weights, gate, up, down)


def _local(
    expert_fn: Callable[..., jax.Array],
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    gathered: bool,
    tensor: str | None,
    fsdp: str | None,
) -> jax.Array:
    """One device: dispatch (all-gather), its experts only, combine (reduce-scatter)."""
    if fsdp is not None:  # FSDP: gather the local experts' embed dim; the backward's
        # transpose is the reduce-scatter of their gradients over `fsdp`
        gate, up = (jax.lax.all_gather(w, fsdp, axis=1, tiled=True) for w in (gate, up))
        down = jax.lax.all_gather(down, fsdp, axis=2, tiled=True)
    if gathered:  # [T_loc, .] -> [n T_loc, .]: the expert group's tokens
        x, experts, weights = (
            jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, experts, weights)
        )
    e_loc = gate.shape[0]
    local = experts - jax.lax.axis_index(EXPERT_AXIS) * e_loc  # [T, K]
    here = (experts >= 0) & (local >= 0) & (local < e_loc)  # [T, K]
    y = expert_fn(  # [T, H] this device's share
        x, jnp.where(here, local, -1), jnp.where(here, weights, 0), gate, up, down
    )
    if gathered:
        y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)  # [T_loc, H]
    else:
        y = jax.lax.psum(y, EXPERT_AXIS)
    if tensor is not None:
        y = jax.lax.psum(y, tensor)
    return y

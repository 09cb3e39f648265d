"""Dropless grouped matmuls over a tile-aligned permutation (Pallas; Triton lowering on GPU).

The MoE expert compute multiplies each routed row by its expert's matrix. Sorting the T*K routed
rows by expert and padding every expert's group to a multiple of ``align`` rows makes each
``align``-row tile belong to exactly one expert, so one kernel launch does all experts: program
``(m, n)`` reads ``e = tile_expert[m]`` and computes ``out[m-tile, n-tile] = x[m-tile] @ w[e]``
(no masking, no dropped token, at most ``E * (align - 1)`` zero rows of padding). The backward
pass is two more kernels of the same shape:

- ``dx = dy @ w[e]^T`` (the forward kernel with the right-hand side transposed);
- ``dw[e] = x_e^T @ dy_e`` (one program per output tile of ``dw[e]``, looping over the tiles of
  group ``e``; empty experts write zeros).

Useful FLOPs of one ``gmm`` of ``R`` routed rows: ``2 R K N`` forward, ``4 R K N`` backward.

On CPU (tests, CI) the same kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from osworld_jax.model.kernels import grouped_matmul_mgpu as mgpu
from osworld_jax.model.kernels.grouped_matmul_mgpu import MosaicConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class GmmConfig:
    """Tile sizes and Triton launch parameters of the grouped matmul kernels.

    Attributes:
      align: group padding multiple in rows; ``block_m`` and ``dw_block_t`` divide it.
      block_m: forward/dx rows per program.
      block_n: forward/dx output columns per program.
      block_k: forward/dx reduction step.
      num_warps: forward/dx warps per program.
      num_stages: forward/dx software-pipelining depth.
      dw_block_m: dw output rows (the forward's K axis) per program.
      dw_block_n: dw output columns (the forward's N axis) per program.
      dw_block_t: dw reduction step over routed rows.
      dw_num_warps: dw warps per program.
      dw_num_stages: dw software-pipelining depth.
      interpret: run in Pallas interpret mode (None: only when the default backend is CPU).
      mosaic_parts: which of "fwd", "dx", "dw" run the Mosaic GPU kernels of
        `grouped_matmul_mgpu` (tiles from ``mosaic``) instead of the Triton ones; ignored in
        interpret mode.
      mosaic: tile sizes of the Mosaic GPU kernels.
    """

    align: int = 128
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    dw_block_m: int = 128
    dw_block_n: int = 256
    dw_block_t: int = 64
    dw_num_warps: int = 8
    dw_num_stages: int = 3
    interpret: bool | None = None
    mosaic_parts: tuple[str, ...] = ()
    mosaic: MosaicConfig = MosaicConfig()

    def __post_init__(self) -> None:
        for name in ("block_m", "dw_block_t"):
            if self.align % getattr(self, name):
                raise ValueError(f"GmmConfig.{name}={getattr(self, name)} must divide align")

    def use_interpret(self) -> bool:
        """Interpret mode: explicit, else whenever the default backend is the CPU."""
        if self.interpret is not None:
            return self.interpret
        return jax.default_backend() == "cpu"

    def mosaic_for(self, part: str) -> bool:
        """Whether ``part`` ("fwd" | "dx" | "dw") runs the Mosaic GPU kernel."""
        return part in self.mosaic_parts and not self.use_interpret()


class TilePlan(NamedTuple):
    """Where each routed row lives in the tile-aligned expert-sorted layout.

    Attributes:
      dest: i32[T*K] padded row of flat slot ``t*K + k``.
      row_slot: i32[Mp] flat slot of each padded row (``T*K`` on padding rows).
      tile_expert: i32[Mp // align] expert of each align-row tile (-1: unused tile).
      group_start: i32[E] first align-tile of expert e.
      group_tiles: i32[E] align-tiles of expert e.
    """

    dest: jax.Array
    row_slot: jax.Array
    tile_expert: jax.Array
    group_start: jax.Array
    group_tiles: jax.Array


def padded_rows(num_rows: int, num_experts: int, align: int) -> int:
    """Static row count ``Mp`` that holds any grouping: ``sum_e ceil(g_e/a) a <= R + E (a-1)``."""
    return -(-(num_rows + num_experts * (align - 1)) // align) * align


def tile_plan(experts: Int[Array, "T K"], num_experts: int, align: int) -> TilePlan:
    """Sorts the T*K routed slots by expert, each group padded to a multiple of ``align``.

    A slot whose expert is ``-1`` is not computed here (expert parallelism: its expert lives on
    another device): it gets no row (``dest >= Mp``, out of range; `_rows` reads zero there).
    A token's K experts are distinct (top-k; replayed rows are checked on the host), so at most
    ``min(K, E)`` of its slots are computed: ``Mp = padded_rows(T min(K, E), E, align)``, which
    is ``padded_rows(T K, ...)`` whenever ``E >= K`` (always, without expert parallelism).
    """
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1).astype(jnp.int32)  # [T*K]
    n = flat.shape[0]
    mp = padded_rows(num_tokens * min(top_k, num_experts), num_experts, align)
    key = jnp.where(flat < 0, num_experts, flat)  # [T*K]; -1 -> the uncomputed group E
    counts = jnp.bincount(key, length=num_experts + 1).astype(jnp.int32)  # [E+1]
    sizes = counts[:num_experts]  # [E]
    tiles = (sizes + align - 1) // align  # [E]
    tile_end = jnp.cumsum(tiles)  # [E]
    tile_start = tile_end - tiles  # [E]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # [T*K] sorted -> slot
    sorted_e = key[order]  # [T*K]
    rank = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_e]  # [T*K]
    start = jnp.concatenate([tile_start * align, jnp.full((1,), mp, jnp.int32)])  # [E+1]
    dest_sorted = start[sorted_e] + rank  # [T*K]; uncomputed slots: Mp, Mp + 1, ...
    dest = jnp.zeros((n,), jnp.int32).at[order].set(dest_sorted, unique_indices=True)
    row_slot = jnp.full((mp,), n, jnp.int32)
    row_slot = row_slot.at[dest_sorted].set(order, mode="drop", unique_indices=True)  # [Mp]
    tile_ids = jnp.arange(mp // align, dtype=jnp.int32)  # [Mp/a]
    owner = jnp.searchsorted(tile_end, tile_ids, side="right").astype(jnp.int32)
    tile_expert = jnp.where(owner < num_experts, owner, -1)  # [Mp/a]
    return TilePlan(dest, row_slot, tile_expert, tile_start.astype(jnp.int32), tiles)


def _rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """``a[index]`` along axis 0, zero where ``index`` is out of range (uncomputed slots)."""
    return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


# ---------------------------------------------------------------------------------------------
# dispatch / combine: gathers both ways (no scatter-add in either direction).


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch(
    x: Float[Array, "T H"], row_slot: jax.Array, dest: jax.Array, top_k: int
) -> Float[Array, "Mp H"]:
    """``xs[r] = x[row_slot[r] // K]`` (zero on padding rows)."""
    x_ext = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])  # [T+1, H]
    return x_ext[row_slot // top_k]


def _dispatch_fwd(x, row_slot, dest, top_k):
    return dispatch(x, row_slot, dest, top_k), (row_slot, dest)


def _dispatch_bwd(top_k, res, dxs):
    row_slot, dest = res
    g = _rows(dxs, dest).reshape(-1, top_k, dxs.shape[-1])  # [T, K, H]
    dx = jnp.sum(g.astype(jnp.float32), axis=1).astype(dxs.dtype)  # [T, H]
    return dx, None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine(
    ys: Float[Array, "Mp H"], weights: Float[Array, "T K"], row_slot: jax.Array, dest: jax.Array
) -> Float[Array, "T H"]:
    """``y[t] = sum_k weights[t, k] ys[dest[t K + k]]`` (f32 accumulation, ``ys.dtype`` out)."""
    t, k = weights.shape
    g = _rows(ys, dest).reshape(t, k, ys.shape[-1])  # [T, K, H]
    y = jnp.einsum("tkh,tk->th", g, weights.astype(ys.dtype), preferred_element_type=jnp.float32)
    return y.astype(ys.dtype)


def _combine_fwd(ys, weights, row_slot, dest):
    return combine(ys, weights, row_slot, dest), (ys, weights, row_slot, dest)


def _combine_bwd(res, dy):
    ys, weights, row_slot, dest = res
    t, k = weights.shape
    w_ext = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])  # [T*K+1]
    dy_ext = jnp.concatenate([dy, jnp.zeros((1, dy.shape[1]), dy.dtype)])  # [T+1, H]
    scale = w_ext[row_slot].astype(dy.dtype)[:, None]  # [Mp, 1]
    dys = (dy_ext[row_slot // k] * scale).astype(ys.dtype)  # [Mp, H]
    g = _rows(ys, dest).reshape(t, k, ys.shape[-1])  # [T, K, H]
    dw = jnp.einsum("tkh,th->tk", g, dy.astype(ys.dtype), preferred_element_type=jnp.float32)
    return dys, dw.astype(weights.dtype), None, None


combine.defvjp(_combine_fwd, _combine_bwd)


# ---------------------------------------------------------------------------------------------
# kernels


def _compiler_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a: jax.Array, b: jax.Array, ca: int, cb: int) -> jax.Array:
    """2-D product contracting ``a``'s axis ``ca`` with ``b``'s axis ``cb``, f32 accumulation."""
    dims = (((ca,), (cb,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _mm_kernel(te_ref, x_ref, w_ref, o_ref, *twin_ref, bm, bn, bk, nk, nn, trans_rhs):
    """Program (m, n): ``o[m, n] = x[m, :] @ w[te[m]][:, n]`` (``w[e]^T`` if trans_rhs).

    With a second output ref (``twin``) the tile is stored into both. An unused tile
    (``te[m] < 0``: past the last group, e.g. the worst-case rows of an expert-parallel
    buffer) is stored as zeros without reading ``x`` or ``w``.
    """
    pid = pl.program_id(0)
    mi, ni = pid // nn, pid % nn
    te = te_ref[mi]
    e = jnp.maximum(te, 0)
    r0 = pl.multiple_of(mi * bm, bm)
    c0 = pl.multiple_of(ni * bn, bn)

    def body(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        a = x_ref[pl.ds(r0, bm), pl.ds(k0, bk)]  # [bm, bk]
        if trans_rhs:
            b = w_ref[e, pl.ds(c0, bn), pl.ds(k0, bk)]  # [bn, bk]
            return acc + _dot(a, b, 1, 1)
        b = w_ref[e, pl.ds(k0, bk), pl.ds(c0, bn)]  # [bk, bn]
        return acc + _dot(a, b, 1, 0)

    def store(acc):
        for ref in (o_ref, *twin_ref):
            ref[pl.ds(r0, bm), pl.ds(c0, bn)] = acc.astype(ref.dtype)

    @pl.when(te >= 0)
    def _():
        store(jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32)))

    @pl.when(te < 0)
    def _():
        store(jnp.zeros((bm, bn), jnp.float32))


def _mm(x, w, tile_expert, cfg: GmmConfig, *, trans_rhs: bool, twin: bool = False):
    """``x [Mp, K]`` times ``w[e] [K, N]`` (or ``w[e]^T`` for ``w [E, N, K]``) per tile.

    ``twin``: return the product twice (two output buffers, see `_expert_mlp`).
    """
    mp, kdim = x.shape
    n = w.shape[1] if trans_rhs else w.shape[2]
    bm, bn, bk = cfg.block_m, min(cfg.block_n, n), min(cfg.block_k, kdim)
    if n % bn or kdim % bk:
        raise ValueError(f"gmm: N={n} / K={kdim} not multiples of block_n={bn} / block_k={bk}")
    te = jnp.repeat(tile_expert, cfg.align // bm)  # [Mp / bm]
    nn = n // bn
    kernel = functools.partial(
        _mm_kernel, bm=bm, bn=bn, bk=bk, nk=kdim // bk, nn=nn, trans_rhs=trans_rhs
    )
    out = jax.ShapeDtypeStruct((mp, n), x.dtype)
    return pl.pallas_call(
        kernel,
        out_shape=(out, out) if twin else out,
        grid=((mp // bm) * nn,),
        compiler_params=_compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=cfg.use_interpret(),
        name="gmm_tn" if trans_rhs else "gmm_nn",
    )(te, x, w)


def _dw_kernel(gs_ref, gt_ref, x_ref, dy_ref, o_ref, *, bm, bn, bt, nn, per_tile):
    """Program (tile, e): ``o[e][m, n] = sum over group e's rows r of x[r, m] dy[r, n]``."""
    pid, e = pl.program_id(0), pl.program_id(1)
    mi, ni = pid // nn, pid % nn
    start = gs_ref[e].astype(jnp.int32) * per_tile
    count = gt_ref[e].astype(jnp.int32) * per_tile
    c_m = pl.multiple_of(mi * bm, bm)
    c_n = pl.multiple_of(ni * bn, bn)

    def body(t, acc):
        r0 = pl.multiple_of((start + t) * bt, bt)
        a = x_ref[pl.ds(r0, bt), pl.ds(c_m, bm)]  # [bt, bm]
        b = dy_ref[pl.ds(r0, bt), pl.ds(c_n, bn)]  # [bt, bn]
        return acc + _dot(a, b, 0, 0)

    zero = jnp.zeros((), jnp.int32)  # same-typed scf.for bounds (Triton verifier)
    acc = jax.lax.fori_loop(zero, count, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[e, pl.ds(c_m, bm), pl.ds(c_n, bn)] = acc.astype(o_ref.dtype)


def _dw(x, dy, group_start, group_tiles, num_experts: int, out_dtype, cfg: GmmConfig):
    """``dw[e] = x_e^T dy_e`` over the tile-aligned groups: [E, K, N]."""
    kdim, n = x.shape[1], dy.shape[1]
    bm, bn, bt = min(cfg.dw_block_m, kdim), min(cfg.dw_block_n, n), cfg.dw_block_t
    if kdim % bm or n % bn:
        raise ValueError(f"gmm dw: K={kdim} / N={n} not multiples of {bm} / {bn}")
    nn = n // bn
    kernel = functools.partial(_dw_kernel, bm=bm, bn=bn, bt=bt, nn=nn, per_tile=cfg.align // bt)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_experts, kdim, n), out_dtype),
        grid=((kdim // bm) * nn, num_experts),
        compiler_params=_compiler_params(cfg.dw_num_warps, cfg.dw_num_stages),
        interpret=cfg.use_interpret(),
        name="gmm_dw",
    )(group_start, group_tiles, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def gmm(
    x: Float[Array, "Mp K"],
    w: Float[Array, "E K N"],
    tile_expert: Int[Array, " tiles"],
    group_start: Int[Array, " E"],
    group_tiles: Int[Array, " E"],
    cfg: GmmConfig,
) -> Float[Array, "Mp N"]:
    """Grouped matmul ``out[r] = x[r] @ w[expert(r)]`` over a `TilePlan` layout.

    Rows of padding (inside a group or in unused tiles) come out zero when ``x``'s are (the
    layout `dispatch` makes).
    """
    return _gmm_forward(x, w, tile_expert, cfg)


def _gmm_forward(x, w, tile_expert, cfg: GmmConfig, *, twin: bool = False):
    """``out[r] = x[r] @ w[expert(r)]``; ``(out, out)`` from two output buffers with ``twin``."""
    if cfg.mosaic_for("fwd"):
        return mgpu.mm_nn(x, w, tile_expert, cfg.align, cfg.mosaic, twin=twin)
    return _mm(x, w, tile_expert, cfg, trans_rhs=False, twin=twin)


def _gmm_fwd(x, w, tile_expert, group_start, group_tiles, cfg):
    out = _gmm_forward(x, w, tile_expert, cfg)
    return out, (x, w, tile_expert, group_start, group_tiles)


def _gmm_dx(dy, w, tile_expert, cfg: GmmConfig) -> jax.Array:
    """``dx[r] = dy[r] @ w[expert(r)]^T``: [Mp, K]."""
    if cfg.mosaic_for("dx"):  # wgmma reads w[e] tiles transposed from shared memory
        return mgpu.mm_nn(dy, w, tile_expert, cfg.align, cfg.mosaic, trans_rhs=True)
    return _mm(dy, w, tile_expert, cfg, trans_rhs=True)


def _gmm_dw(x, dy, group_start, group_tiles, w, cfg: GmmConfig) -> jax.Array:
    """``dw[e] = x_e^T dy_e``: [E, K, N] in ``w.dtype``."""
    if cfg.mosaic_for("dw"):
        dw = mgpu.mm_dw(x, dy, group_start, group_tiles, w.shape[0], cfg.align, cfg.mosaic)
        return dw.astype(w.dtype)
    return _dw(x, dy, group_start, group_tiles, w.shape[0], w.dtype, cfg)


def _gmm_bwd(cfg, res, dy):
    x, w, tile_expert, group_start, group_tiles = res
    dy = dy.astype(x.dtype)
    dx = _gmm_dx(dy, w, tile_expert, cfg)  # [Mp, K]
    dw = _gmm_dw(x, dy, group_start, group_tiles, w, cfg)  # [E, K, N]
    return dx, dw, None, None, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


# The Triton kernels' defaults: the tiles that won the Triton backward on an H200
# (mm128x256x64w8s3 dw128x256x64w8s3: dx 502, dw 555 useful TFLOP/s; issue 19).
DEFAULT_CONFIG = GmmConfig()
# The Hopper config (benchmarks/NOTES.md, issue 19): the Mosaic forward (606-626 TFLOP/s,
# M-minor bands of 4), the Mosaic transposed-B dx (539-563) and the Mosaic dw (484-524; the
# Triton dw measured 531 and 511 in the same calls). Mosaic for dw too because in the train
# step a Mosaic call's output is written in place into the layer-stacked gradient (XLA's
# dynamic-slice fusion takes FFI custom calls, not Triton ones): the Triton dw's output was
# copied there, 3 x 403 MB read + written per layer.
MOSAIC_CONFIG = GmmConfig(
    mosaic_parts=("fwd", "dx", "dw"),
    mosaic=MosaicConfig(
        max_concurrent_steps=3,
        grid_minor_n=False,
        grid_tile_width=4,
        dw_block_m=128,
        dw_block_n=128,
        dw_block_k=64,
        dw_max_concurrent_steps=4,
    ),
)


def config_to_dict(cfg: GmmConfig) -> dict:
    """JSON-able form of a `GmmConfig` (for benchmark outputs)."""
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> GmmConfig:
    """Inverse of `config_to_dict`."""
    d = dict(d)
    d["mosaic"] = MosaicConfig(**d.get("mosaic", {}))
    d["mosaic_parts"] = tuple(d.get("mosaic_parts", ()))
    return GmmConfig(**d)


def default_config() -> GmmConfig:
    """The shipped config of this device: `MOSAIC_CONFIG` on Hopper, else `DEFAULT_CONFIG`."""
    if jax.default_backend() == "gpu":
        if str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
            return MOSAIC_CONFIG
    return DEFAULT_CONFIG


def configure(*, triton: GmmConfig | None = None, mosaic: GmmConfig | None = None) -> None:
    """Replaces the configs the ``pallas_gmm`` / ``pallas_gmm_mosaic`` backends use (tuning)."""
    global DEFAULT_CONFIG, MOSAIC_CONFIG
    if triton is not None:
        DEFAULT_CONFIG = triton
    if mosaic is not None:
        MOSAIC_CONFIG = mosaic


@jax.custom_vjp
def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """``silu(g) * u`` computed in float32, returned in ``g.dtype``.

    A ``custom_vjp`` whose residuals are ``g`` and ``u`` themselves (bf16 in training): plain
    autodiff of the float32 expression keeps the float32 upcasts of both ``[Mp, I]`` inputs,
    which a scan over layers then stacks (``4 x [L, Mp, I]`` float32 buffers). Backward, with
    ``s = sigmoid(g)``: ``dg = dh u s (1 + g (1 - s))``, ``du = dh g s``.
    """
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)


def _swiglu_fwd(g, u):
    return swiglu(g, u), (g, u)


def _swiglu_bwd(res, dh):
    g, u = res
    gf, uf, dhf = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
    s = jax.nn.sigmoid(gf)
    dg = dhf * uf * s * (1.0 + gf * (1.0 - s))
    du = dhf * gf * s
    return dg.astype(g.dtype), du.astype(u.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


_BATCH_AXES = ("data", "fsdp", "expert")


def gmm_experts(
    x: Float[Array, "T H"],
    experts: Int[Array, "T K"],
    weights: Float[Array, "T K"],
    gate: Float[Array, "E H I"],
    up: Float[Array, "E H I"],
    down: Float[Array, "E I H"],
    *,
    config: GmmConfig | None = None,
) -> Float[Array, "T H"]:
    """The ``"pallas_gmm"`` expert backend: tile-aligned permute -> 3 grouped matmuls -> combine.

    ``y_t = sum_k w_tk down_e(silu(gate_e x_t) * up_e x_t)``, ``e = experts[t, k]``; dropless.
    Under an ambient mesh (``jax.set_mesh``) whose batch axes (data/fsdp/expert) divide T, each
    device runs the kernels on its own tokens (``shard_map``; the expert weights are gathered,
    their gradients summed over those axes), since a Pallas call cannot be partitioned by GSPMD.
    """
    config = DEFAULT_CONFIG if config is None else config
    mesh = jax.sharding.get_abstract_mesh()
    axes: tuple[str, ...] = ()
    if not mesh.empty:  # axes already manual (inside a shard_map, e.g. expert parallelism)
        free = [a for a in mesh.axis_names if a not in mesh.manual_axes]
        axes = tuple(a for a in _BATCH_AXES if a in free and mesh.shape[a] > 1)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    local = functools.partial(_gmm_experts_local, config=config)
    if not axes or x.shape[0] % size:
        return local(x, experts, weights, gate, up, down)
    rows, rep = jax.sharding.PartitionSpec(axes), jax.sharding.PartitionSpec()
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, rep, rep, rep),
        out_specs=rows,
        check_vma=False,  # pallas_call outputs carry no varying-axes annotation
    )(x, experts, weights, gate, up, down)


def _gmm_experts_local(x, experts, weights, gate, up, down, *, config: GmmConfig) -> jax.Array:
    top_k = experts.shape[1]
    plan = tile_plan(experts, gate.shape[0], config.align)
    xs = dispatch(x, plan.row_slot, plan.dest, top_k)  # [Mp, H]
    return _expert_mlp(
        xs,
        weights.astype(xs.dtype),
        gate,
        up,
        down,
        plan.row_slot,
        plan.dest,
        plan.tile_expert,
        plan.group_start,
        plan.group_tiles,
        config,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _expert_mlp(xs, weights, gate, up, down, row_slot, dest, te, gs, gt, cfg: GmmConfig):
    """``y_t = sum_k w_tk down_e(silu(gate_e xs_r) * up_e xs_r)``, ``r = dest[t K + k]``: [T, H].

    The expert MLP of `gmm_experts` on dispatched rows ``xs [Mp, H]``, as one ``custom_vjp``
    whose residuals are chosen here rather than by autodiff: the gate, up and down kernels
    write their outputs twice (``twin``), one copy for the next op and one that is only a
    residual. Under ``jax.lax.scan`` over layers the residuals are stacked per layer; when a
    residual *is* an output a later op also reads, XLA's dynamic-slice fusion (on by default
    for the Mosaic custom calls) fuses the kernel with the residual's in-place update and keeps
    a second copy of the kernel for the other reader: every forward expert GEMM ran twice
    (issue 19, round 3). With a residual-only twin the kernel runs once.
    """
    g = _gmm_forward(xs, gate, te, cfg)
    u = _gmm_forward(xs, up, te, cfg)
    ys = _gmm_forward(swiglu(g, u), down, te, cfg)
    return combine(ys, weights, row_slot, dest)


def _expert_mlp_fwd(xs, weights, gate, up, down, row_slot, dest, te, gs, gt, cfg):
    g, g_res = _gmm_forward(xs, gate, te, cfg, twin=True)  # [Mp, I] x 2
    u, u_res = _gmm_forward(xs, up, te, cfg, twin=True)  # [Mp, I] x 2
    h = swiglu(g, u)  # [Mp, I]
    ys, ys_res = _gmm_forward(h, down, te, cfg, twin=True)  # [Mp, H] x 2
    y = combine(ys, weights, row_slot, dest)  # [T, H]
    return y, (xs, g_res, u_res, h, ys_res, weights, gate, up, down, row_slot, dest, te, gs, gt)


def _expert_mlp_bwd(cfg, res, dy):
    xs, g, u, h, ys, weights, gate, up, down, row_slot, dest, te, gs, gt = res
    dys, dweights, _, _ = _combine_bwd((ys, weights, row_slot, dest), dy)  # [Mp, H], [T, K]
    dh = _gmm_dx(dys, down, te, cfg)  # [Mp, I]
    ddown = _gmm_dw(h, dys, gs, gt, down, cfg)  # [E, I, H]
    dg, du = _swiglu_bwd((g, u), dh)  # [Mp, I] x 2
    dxs = _gmm_dx(dg, gate, te, cfg) + _gmm_dx(du, up, te, cfg)  # [Mp, H]
    dgate = _gmm_dw(xs, dg, gs, gt, gate, cfg)  # [E, H, I]
    dup = _gmm_dw(xs, du, gs, gt, up, cfg)  # [E, H, I]
    return dxs, dweights, dgate, dup, ddown, None, None, None, None, None


_expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)

"""Mosaic GPU (Hopper: TMA + wgmma) versions of the tile-aligned grouped matmul kernels.

Same layout contract as `grouped_matmul` (rows sorted by expert, each group padded to a multiple
of ``align`` rows, padding rows zero), for Hopper GPUs (the non-transposed forward also runs in
the Mosaic GPU interpreter, for CPU tests). Two kernels:

- `mm_nn`: ``out[m-tile] = x[m-tile] @ w[tile_expert[m]]``; a persistent, warp-specialized
  kernel (one TMA producer warpgroup, two wgmma consumer warpgroups splitting the N tile), the
  structure of ``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`` with the right-hand side
  picked per row tile. Unused tiles compute zeros from zero rows (their rows are padding).
  ``trans_rhs=True`` multiplies by ``w[e]^T`` (the dx of the backward): the TMA loads
  ``[N-tile, K-step]`` blocks of ``w[e]`` and wgmma reads them transposed from shared memory,
  so no transposed copy of the weights is ever written.
- `mm_dw`: ``dw[e] = x_e^T dy_e``; a persistent kernel over (expert, output tile) whose
  pipeline runs over the (dynamic) row blocks of group ``e`` (the structure of
  ``transposed_ragged_dot_mgpu`` without its boundary masks: aligned groups need none).

Written against jax 0.11 (`plgpu`); imported lazily so CPU installs never load it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU kernels.

    Attributes:
      tile_m: rows per consumer warpgroup tile (the CTA covers ``tile_m`` rows; divides align).
      tile_n: columns per consumer warpgroup (the CTA covers ``2 * tile_n``).
      tile_k: reduction step.
      max_concurrent_steps: pipeline depth (shared-memory stages).
      grid_minor_n: walk output tiles N-fastest (else M-fastest).
      grid_tile_width: planar-snake band width.
      dw_block_m: dw output rows per CTA.
      dw_block_n: dw output columns per CTA.
      dw_block_k: dw reduction step over routed rows (divides align).
      dw_max_concurrent_steps: dw pipeline depth.
      skip_unused_tiles: `mm_nn` leaves the output tiles of unused row tiles
        (``tile_expert < 0``) unwritten instead of computing zeros (the expert MLP never reads
        them; expert parallelism sizes its buffer for the worst case, mostly unused).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    grid_minor_n: bool = True
    grid_tile_width: int = 1
    dw_block_m: int = 128
    dw_block_n: int = 128
    dw_block_k: int = 64
    dw_max_concurrent_steps: int = 4
    skip_unused_tiles: bool = False


def _num_sms(interpret: bool = False) -> int:
    if interpret:  # Mosaic GPU interpret mode on the CPU: a few persistent CTAs
        return 4
    return int(jax.devices()[0].core_count)


def _interpret_params(interpret: bool):
    """``plgpu.kernel``'s ``interpret`` argument: the Mosaic GPU interpreter (CPU tests)."""
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _transforms(plgpu, block_minor: int, dtype):
    swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def mm_nn(
    x: jax.Array,
    w: jax.Array,
    tile_expert: jax.Array,
    align: int,
    cfg: MosaicConfig,
    *,
    trans_rhs: bool = False,
    twin: bool = False,
    interpret: bool = False,
):
    """``x [Mp, K] @ w[e] [K, N]`` per ``align``-row tile (``e = max(tile_expert, 0)``).

    With ``trans_rhs``, ``w`` is ``[E, N, K]`` and the product is ``x @ w[e]^T``. With ``twin``
    the kernel returns the product twice, ``(out, out)``: each epilogue tile is stored by two
    TMA copies from the same shared-memory tile (one more write of ``Mp x N``, no more reads).
    ``interpret`` runs the kernel in the Mosaic GPU interpreter (CPU; not with ``trans_rhs``,
    whose transposed shared-memory view the interpreter of jax 0.10 does not support).
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    mp, k = x.shape
    n = w.shape[1] if trans_rhs else w.shape[2]
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tile_n
    if align % tile_m or mp % tile_m or n % cta_n or k % tile_k:
        raise ValueError(f"mm_nn: shapes {x.shape} x {w.shape} do not tile by {cfg}")
    te = jnp.repeat(tile_expert, align // tile_m).astype(jnp.int32)
    if not cfg.skip_unused_tiles:
        te = jnp.maximum(te, 0)  # unused tiles: zero rows times expert 0 = zeros
    m_iters, n_iters, k_iters = mp // tile_m, n // cta_n, k // tile_k
    dtype = x.dtype
    transforms = _transforms(plgpu, tile_k, dtype)
    epi_m, epi_n = 64, 64
    out_transforms = _transforms(plgpu, epi_n, dtype)
    minor = 1 if cfg.grid_minor_n else 0

    def body(te_gmem, a_gmem, b_gmem, out_gmem, *twin_gmem):
        def get_pipeline(pipeline_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                pipeline_body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec(
                        (tile_m, tile_k),
                        lambda kk: (0, kk),
                        transforms=transforms,
                        memory_space=plgpu.SMEM,
                    ),
                    plgpu.BlockSpec(
                        (cta_n, tile_k) if trans_rhs else (tile_k, cta_n),
                        (lambda kk: (0, kk)) if trans_rhs else (lambda kk: (kk, 0)),
                        transforms=transforms,
                        memory_space=plgpu.SMEM,
                    ),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=cfg.max_concurrent_steps,
                compute_context=compute_context,
            )

        def ignore(*_, **__):
            return None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0]),
            out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), dtype, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _mn_loop(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, cfg.grid_tile_width)
                e = te_gmem[mi]
                m_sl = pl.ds(mi * tile_m, tile_m)
                n_sl = pl.ds(ni * cta_n, cta_n)
                wg_n = pl.ds(wg * tile_n, tile_n)

                def compute_context(eval_pipeline):
                    @functools.partial(
                        pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32)
                    )
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for em in range(tile_m // epi_m):
                            for en in range(tile_n // epi_n):
                                ms = slice(em * epi_m, (em + 1) * epi_m)
                                ns = slice(en * epi_n, (en + 1) * epi_n)
                                slot = (em * (tile_n // epi_n) + en) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = acc[ms, ns]
                                plgpu.commit_smem()
                                # One bulk group per slot: both copies of a twin kernel.
                                for i, dst in enumerate((out_gmem, *twin_gmem)):
                                    plgpu.copy_smem_to_gmem(
                                        out_smem.at[wg, slot],
                                        dst.at[m_sl, n_sl].at[:, wg_n].at[ms, ns],
                                        commit_group=i == len(twin_gmem),
                                    )

                def mma_body(idxs, a_smem, b_smem, acc_ref):
                    if trans_rhs:
                        plgpu.wgmma(acc_ref, a_smem, b_smem.at[wg_n, :].transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, wg_n])
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def run_tile():
                    get_pipeline(mma_body, compute_context)(
                        a_gmem.at[m_sl, :],
                        b_gmem.at[e].at[n_sl, :] if trans_rhs else b_gmem.at[e].at[:, n_sl],
                        allocations=pipeline_allocs,
                    )

                if cfg.skip_unused_tiles:
                    pl.when(e >= 0)(run_tile)
                else:
                    run_tile()

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out = jax.ShapeDtypeStruct((mp, n), dtype)
    kernel = plgpu.kernel(
        body,
        out_type=(out, out) if twin else out,
        grid=(_num_sms(interpret),),
        grid_names=("cluster_grid",),
        cluster=(1,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
    )
    return kernel(te, x, w)


def _transpose(plgpu, ref):
    if hasattr(plgpu, "transpose_ref"):
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))


def mm_dw(
    x: jax.Array,
    dy: jax.Array,
    group_start: jax.Array,
    group_tiles: jax.Array,
    num_experts: int,
    align: int,
    cfg: MosaicConfig,
):
    """``dw[e] = x_e^T dy_e`` for ``x [Mp, K]``, ``dy [Mp, N]`` over aligned groups: [E, K, N]."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    mp, m = x.shape
    n = dy.shape[1]
    bm, bn, bk = cfg.dw_block_m, cfg.dw_block_n, cfg.dw_block_k
    if m % bm or n % bn or align % bk:
        raise ValueError(f"mm_dw: K={m} N={n} align={align} do not tile by {cfg}")
    starts = (group_start * align).astype(jnp.int32)
    nblocks = (group_tiles * (align // bk)).astype(jnp.int32)
    transforms = _transforms(plgpu, bk, x.dtype)
    mcs = cfg.dw_max_concurrent_steps
    grid_m, grid_n = m // bm, n // bn

    def body(starts_gmem, nblocks_gmem, lhs_gmem, rhs_gmem, o_gmem):
        @plgpu.nd_loop((num_experts, grid_m * grid_n), collective_axes="sm")
        def _loop(info):
            g = info.index[0]
            mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, 1)
            start = pl.multiple_of(starts_gmem[g], bk)
            nb = nblocks_gmem[g]
            rows = pl.ds(start, mp)  # may overrun Mp; the pipeline reads only nb blocks

            def acc_scope(acc_ref):
                def block(_, lhs_smem, rhs_smem):
                    plgpu.wgmma(acc_ref, _transpose(plgpu, lhs_smem), rhs_smem)
                    if mcs == 1:
                        plgpu.wgmma_wait(0)

                @pl.when(nb > 0)
                def _():
                    plgpu.emit_pipeline(
                        block,
                        grid=(nb,),
                        in_specs=[
                            plgpu.BlockSpec(
                                (bk, bm),
                                lambda kk: (kk, mi),
                                delay_release=1 if mcs > 1 else 0,
                                transforms=transforms,
                            ),
                            plgpu.BlockSpec(
                                (bk, bn),
                                lambda kk: (kk, ni),
                                delay_release=1 if mcs > 1 else 0,
                                transforms=transforms,
                            ),
                        ],
                        max_concurrent_steps=mcs,
                    )(lhs_gmem.at[rows, :], rhs_gmem.at[rows, :])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(
                pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_gmem.dtype, transforms=transforms)
            )
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_experts, m, n), x.dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(starts, nblocks, x, dy)

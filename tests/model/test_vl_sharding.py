"""Qwen3-VL on an 8-device CPU mesh (fsdp, expert, tensor): logits and gradients equal 1 device.

The ViT runs data-parallel over rows: per-row pixels [B, Np, P] split over the batch axes like
the tokens, each row's images feeding that row's image tokens.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from osworld_jax.model import (
    Policy,
    ShardingRules,
    forward,
    make_mesh,
    mrope_positions,
    param_shardings,
)
from tests.model.conftest import TINY_RT
from tests.model.vl_helpers import PROCESSOR, images, ours_config, prompt

B = 4


def _batch():
    """4 rows with 1, 2, 0 and 1 images (per-row layout, padding patches after each row's)."""
    cfg = ours_config()
    per_row = [[(20, 36)], [(40, 17), (9, 9)], [], [(16, 24)]]
    rng = np.random.RandomState(0)
    rows, pixels, grids = [], [], []
    for r, sizes in enumerate(per_row):
        pv, grid = PROCESSOR(images(r, sizes)) if sizes else PROCESSOR([])
        rows.append(prompt(rng, grid))
        pixels.append(pv)
        grids.append(grid)
    s = max(map(len, rows)) + 2
    ids = np.zeros((B, s), np.int32)
    seg = np.zeros((B, s), np.int32)
    for r, row in enumerate(rows):
        ids[r, : len(row)], seg[r, : len(row)] = row, 1
    np_rows = 64
    pv = np.zeros((B, np_rows, PROCESSOR.patch_dim), np.float32)
    grid = np.zeros((B, 2, 3), np.int32)
    for r in range(B):
        pv[r, : len(pixels[r])] = pixels[r]
        grid[r, : len(grids[r])] = grids[r]
    pos = mrope_positions(ids, grid, cfg, segment_ids=seg)
    return cfg, tuple(jnp.asarray(x) for x in (ids, pos, seg, pv, grid))


def _loss_fn(cfg, runtime):
    def loss(params, ids, pos, seg, pv, grid):
        out = forward(
            params,
            cfg,
            runtime,
            ids,
            positions=pos,
            segment_ids=seg,
            pixel_values=pv,
            image_grid_thw=grid,
        )
        lp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
        tok = jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]
        mask = seg[:, 1:] != 0
        nll = -jnp.sum(tok * mask) / jnp.sum(mask)
        return nll + 0.01 * out.aux["load_balancing_loss"], out.logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.slow
def test_vl_sharded_8_devices_equals_one_device():
    cfg, batch = _batch()
    cfg = dataclasses.replace(cfg, initializer_range=0.1)
    params = Policy(cfg, TINY_RT, rngs=nnx.Rngs(0)).params()
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    shardings = param_shardings(cfg, mesh)
    assert shardings["vision_blocks"]["fc1"].spec == PartitionSpec(None, ("fsdp",), ("tensor",))
    assert shardings["deepstack"]["fc2"].spec == PartitionSpec(None, ("tensor",), ("fsdp",))
    sharded = jax.device_put(params, shardings)
    rules = ShardingRules()
    rows = NamedSharding(mesh, rules.batch_spec(B, mesh, 2))
    batch_sh = (
        jax.device_put(batch[0], rows),
        jax.device_put(
            batch[1], NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp", "expert")))
        ),
        jax.device_put(batch[2], rows),
        jax.device_put(batch[3], NamedSharding(mesh, rules.batch_spec(B, mesh, 3))),
        jax.device_put(batch[4], NamedSharding(mesh, rules.batch_spec(B, mesh, 3))),
    )
    for backend in ("dense", "ragged"):
        fn = _loss_fn(cfg, dataclasses.replace(TINY_RT, expert_backend=backend))
        (l1, logits1), g1 = fn(params, *batch)
        with jax.set_mesh(mesh):
            (l8, logits8), g8 = fn(sharded, *batch_sh)
        assert len(g8["vision_blocks"]["qkv"].sharding.device_set) == 8
        np.testing.assert_allclose(l8, l1, rtol=2e-5)
        np.testing.assert_allclose(logits8, logits1, rtol=2e-5, atol=2e-6)
        chex.assert_trees_all_close(g8, g1, rtol=2e-5, atol=2e-6)
    assert float(jnp.abs(g1["vision"]["patch_embed"]).max()) > 0  # pixels get gradients
    assert float(jnp.abs(g1["deepstack"]["fc1"]).max()) > 0

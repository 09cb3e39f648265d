"""The Mosaic GPU flash kernel at head width 80: its padding and key mask (CPU, stand-in kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import flash_mgpu


def _softmax_kernel(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """What jax's kernel computes at the padded shapes: softmax(q k^T) v, no scale, no mask."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest")
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")


def _reference(q, k, v, lengths):
    t = q.shape[1]
    mask = jnp.arange(t)[None, None, None, :] < lengths[:, None, None, None]  # [B, 1, 1, T]
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


@pytest.mark.parametrize("lengths", [None, (100, 37)])
def test_padded_attention_equals_attention_values_and_grads(lengths):
    """72 -> 80 columns, 100 -> 128 patches; keys past a row's length weigh exactly 0."""
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(x, (2, 100, 3, 72), jnp.float32) for x in ks)
    lens = jnp.asarray(lengths or (100, 100), jnp.int32)
    cfg = flash_mgpu.FlashConfig()

    def ours(q, k, v):
        kw = {} if lengths is None else {"lengths": lens}
        return flash_mgpu.padded_attention(q, k, v, cfg, kernel=_softmax_kernel, **kw)

    def ref(q, k, v):
        return _reference(q, k, v, lens)

    valid = (jnp.arange(100)[None, :] < lens[:, None])[:, :, None, None]  # queries that count
    np.testing.assert_allclose(
        jnp.where(valid, ours(q, k, v), 0), jnp.where(valid, ref(q, k, v), 0), atol=2e-6
    )

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(jnp.where(valid, f(*a), 0) * g), (0, 1, 2))(q, k, v)

    for a, b in zip(grads(ours), grads(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_kernel_source_changes_apply_to_the_installed_jax():
    """The textual changes find their lines in this jax's attention_mgpu (else one line)."""
    module = flash_mgpu.kernels()
    assert module._tile_cols(80) == 16 and module._tile_cols(128) == 64
    tuning = flash_mgpu.FlashConfig().tuning()
    assert tuning.block_kv == 128 and tuning.compute_wgs_bwd == 2
    assert flash_mgpu.FlashConfig().unit == 128

"""The jaxtyping shape annotations of the model's array functions hold (checked with beartype)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import BeartypeConf, beartype
from jaxtyping import TypeCheckError, jaxtyped

from osworld_jax.model import layers, moe, rope
from tests.model.conftest import TINY_CFG

_checker = beartype(conf=BeartypeConf(is_pep484_tower=True))


def checked(fn):
    return jaxtyped(fn, typechecker=_checker)


T, K, E, H, W, B, S, N, KV, D = 6, 2, 4, 8, 5, 2, 3, 4, 2, 8
KEY = jax.random.split(jax.random.key(0), 6)
X = jax.random.normal(KEY[0], (T, H))
ROUTER = jax.random.normal(KEY[1], (H, E))
GATE = jax.random.normal(KEY[2], (E, H, W))
UP = jax.random.normal(KEY[3], (E, H, W))
DOWN = jax.random.normal(KEY[4], (E, W, H))


def test_routing_and_expert_annotations():
    r = checked(moe.route)(X, ROUTER, top_k=K, norm_topk_prob=True)
    assert r.experts.shape == (T, K) and r.probs.shape == (T, E)
    replay = jnp.asarray(np.array([[0, 1]] * T, np.int32))
    checked(moe.route)(X, ROUTER, top_k=K, norm_topk_prob=True, replay=replay)
    for fn in (moe.dense_experts, moe.ragged_experts):
        assert checked(fn)(X, r.experts, r.weights, GATE, UP, DOWN).shape == (T, H)
    assert checked(moe.swiglu_mlp)(X, GATE[0], UP[0], DOWN[0]).shape == (T, H)
    with pytest.raises(TypeCheckError):  # router built for another hidden size
        checked(moe.route)(X, ROUTER[:4], top_k=K, norm_topk_prob=True)
    with pytest.raises(TypeCheckError):  # down projection with a mismatched width
        checked(moe.dense_experts)(X, r.experts, r.weights, GATE, UP, DOWN[:, :3])


def test_attention_and_rope_annotations():
    pos = jnp.tile(jnp.arange(S), (B, 1))
    seg = jnp.ones((B, S), jnp.int32)
    mask = checked(layers.segment_mask)(seg, pos)
    assert mask.shape == (B, S, S)
    q = jax.random.normal(KEY[5], (B, S, N, D))
    kv = q[:, :, :KV]
    inv_freq, scale = rope.rope_frequencies(TINY_CFG)
    cos, sin = checked(rope.rope_cos_sin)(pos, inv_freq, scale)
    assert checked(rope.apply_rope)(q, cos, sin).shape == (B, S, N, D)
    assert checked(layers.attention)(q, kv, kv, mask).shape == (B, S, N, D)
    assert checked(layers.rms_norm)(q, jnp.ones(D), 1e-6).shape == q.shape
    with pytest.raises(TypeCheckError):  # mask for another query length
        checked(layers.attention)(q, kv, kv, mask[:, :2])


def test_vision_and_mrope_annotations():
    from osworld_jax.model import vision
    from tests.model.vl_helpers import ours_config

    cfg = ours_config()
    v = cfg.vision
    pos3 = jnp.tile(jnp.arange(S), (3, B, 1))
    inv_freq, scale = rope.rope_frequencies(cfg)
    cos, _ = checked(rope.mrope_cos_sin)(pos3, inv_freq, scale, cfg.mrope_axes)
    assert cos.shape == (B, S, cfg.head_dim)
    grid = jnp.asarray([[1, 2, 4], [1, 2, 2]], jnp.int32)
    n = 16  # 8 + 4 patches of two images, then 4 padding patches
    layout = checked(vision.patch_layout)(grid, n, v)
    assert layout.taps.shape == (n, 4) and layout.segment.shape == (n,)
    vcos, vsin = checked(vision.vision_rope)(layout.row, layout.col, v)
    assert vcos.shape == (n, v.head_dim)
    q = jax.random.normal(KEY[0], (n, v.num_heads, v.head_dim))
    assert checked(vision.segment_attention)(q, q, q, layout.segment, 4).shape == q.shape
    x = jax.random.normal(KEY[1], (n, v.hidden_size))
    ones, zeros = jnp.ones(v.hidden_size), jnp.zeros(v.hidden_size)
    assert checked(vision.layer_norm)(x, ones, zeros).shape == x.shape
    with pytest.raises(TypeCheckError):  # a grid row of two values
        checked(vision.patch_layout)(grid[:, :2], n, v)
    with pytest.raises(TypeCheckError):  # keys of another head width
        checked(vision.segment_attention)(q, q[..., :4], q, layout.segment)

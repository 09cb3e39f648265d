"""KV-cache decoding equals one full forward; packed segments never attend across."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osworld_jax.model import (
    forward,
    init_kv_cache,
)
from tests.model.conftest import TINY_CFG, TINY_RT, jforward, tiny_policy

CFG, RT = TINY_CFG, TINY_RT
_policy = tiny_policy


def test_prefill_then_decode_equals_full_forward():
    policy = _policy()
    params = policy.params()
    rng = np.random.RandomState(0)
    total, max_len, b = 14, 32, 2
    ids = rng.randint(0, 64, (b, total)).astype(np.int32)
    full = np.asarray(jforward(policy, jnp.asarray(ids)).logits)  # [B, total, V]

    @jax.jit
    @chex.assert_max_traces(n=1)
    def decode(params, tok, pos, cache):
        out = forward(params, CFG, RT, tok, positions=pos, kv_cache=cache)
        return out.logits, out.kv_cache

    # Row 0 prefills 6 tokens, row 1 prefills 4 (+2 padding tokens at positions past its length).
    cache = init_kv_cache(CFG, b, max_len, jnp.float32)
    chex.assert_shape(cache.k, (3, b, max_len, 2, 8))
    lens = np.array([6, 4])
    pre_ids = ids[:, :6].copy()
    pre_pos = np.stack([np.arange(6), np.array([0, 1, 2, 3, 30, 31])]).astype(np.int32)
    pre_ids[1, 4:] = 0
    out = jforward(
        params,
        jnp.asarray(pre_ids),
        positions=jnp.asarray(pre_pos),
        kv_cache=cache,
        config=CFG,
        runtime=RT,
    )
    cache = out.kv_cache
    pre_logits = np.asarray(out.logits)
    np.testing.assert_allclose(pre_logits[0], full[0, :6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pre_logits[1, :4], full[1, :4], rtol=1e-5, atol=1e-5)
    # Then one token per step per row; each row at its own position.
    for _ in range(total - 6):
        tok = ids[np.arange(b), lens][:, None]
        logits, cache = decode(
            params, jnp.asarray(tok), jnp.asarray(lens[:, None], jnp.int32), cache
        )
        logits = np.asarray(logits)
        for r in range(b):
            np.testing.assert_allclose(logits[r, 0], full[r, lens[r]], rtol=1e-5, atol=1e-5)
        lens = lens + 1
        if lens.max() >= total:
            break


def test_prefill_into_a_cache_in_query_blocks_equals_one_block():
    """The server's long prefills attend in query blocks (`runner.prefill_query_chunk`)."""
    import dataclasses

    params = _policy().params()
    rng = np.random.RandomState(1)
    ids = jnp.asarray(rng.randint(0, 64, (2, 11)).astype(np.int32))
    pos = jnp.asarray(np.stack([np.arange(3, 14), np.arange(11)]).astype(np.int32))
    cache = init_kv_cache(CFG, 2, 16, jnp.float32)
    cache = cache._replace(k=cache.k + 0.5, v=cache.v - 0.25)  # a kept prefix in rows [0, 3)
    one = jforward(params, ids, positions=pos, kv_cache=cache, config=CFG, runtime=RT)
    rt = dataclasses.replace(RT, attention_chunk=4)  # 3 blocks, the last one padded
    blocks = jforward(params, ids, positions=pos, kv_cache=cache, config=CFG, runtime=rt)
    np.testing.assert_allclose(blocks.logits, one.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blocks.kv_cache.k, one.kv_cache.k, rtol=1e-5, atol=1e-5)


def test_stale_cache_slots_are_never_seen():
    """Garbage beyond a row's position (e.g. from a previous request) does not change logits."""
    policy = _policy()
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 64, (1, 8)), jnp.int32)
    pos = jnp.arange(8)[None]
    clean = init_kv_cache(CFG, 1, 16, jnp.float32)
    dirty = jax.tree.map(lambda a: a + 100.0, clean)
    a = jforward(policy, ids, positions=pos, kv_cache=clean).logits
    b = jforward(policy, ids, positions=pos, kv_cache=dirty).logits
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 4])
def test_fresh_prefill_attending_to_its_own_keys_equals_attending_to_the_cache(chunk):
    """``cache_fresh`` (the server's prefill keeping no prefix): the queries attend to their
    own keys (causal, padding after each row's length), not the cache written first; real
    tokens' logits and cache rows are the same, in one query block or several."""  # noqa: D205, D209
    import dataclasses

    params = _policy().params()
    rng = np.random.RandomState(4)
    b, s, max_len = 3, 11, 16
    ids = jnp.asarray(rng.randint(0, 64, (b, s)), jnp.int32)
    lengths = np.array([11, 6, 1])
    seg = jnp.asarray((np.arange(s)[None] < lengths[:, None]).astype(np.int32))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cache = init_kv_cache(CFG, b, max_len, jnp.float32)
    rt = dataclasses.replace(RT, attention_chunk=chunk)
    kw = dict(positions=pos, segment_ids=seg, kv_cache=cache, cache_positions=pos)
    cached = forward(params, CFG, rt, ids, **kw)
    own = forward(params, CFG, rt, ids, cache_fresh=True, **kw)
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(own.logits[r, :n], cached.logits[r, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            own.kv_cache.k[:, r, :n], cached.kv_cache.k[:, r, :n], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            own.kv_cache.v[:, r, :n], cached.kv_cache.v[:, r, :n], rtol=1e-5, atol=1e-5
        )
    assert np.isfinite(np.asarray(own.logits)).all()


def test_scanned_layers_carry_the_cache_as_unrolled_ones_do():
    """The whole cache rides the layer loop's carry (`forward`): under `lax.scan` (accelerators)
    each layer writes and reads the same rows as unrolled (CPU)."""  # noqa: D205, D209
    import dataclasses

    params = _policy().params()
    rng = np.random.RandomState(5)
    ids = jnp.asarray(rng.randint(0, 64, (2, 5)), jnp.int32)
    pos = jnp.asarray(np.stack([np.arange(3, 8), np.arange(5)]), jnp.int32)
    cache = init_kv_cache(CFG, 2, 16, jnp.float32)
    cache = cache._replace(k=cache.k + 0.3, v=cache.v - 0.2)  # a kept prefix in row 0's [0, 3)
    outs = []
    for scan in (False, True):
        rt = dataclasses.replace(RT, scan_layers=scan)
        run = jax.jit(lambda p, i, c, rt=rt: forward(p, CFG, rt, i, positions=pos, kv_cache=c))
        outs.append(run(params, ids, cache))
    np.testing.assert_allclose(outs[1].logits, outs[0].logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[1].kv_cache.k, outs[0].kv_cache.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[1].kv_cache.v, outs[0].kv_cache.v, rtol=1e-6, atol=1e-6)


def test_packed_segments_do_not_attend_across():
    policy = _policy()
    rng = np.random.RandomState(2)
    s1, s2 = rng.randint(1, 64, 5), rng.randint(1, 64, 7)
    pad = lambda a: np.concatenate([a, np.zeros(15 - len(a), a.dtype)])  # noqa: E731
    # Row 0 packs s1 | s2 | 3 padding tokens; rows 1 and 2 hold s1 and s2 alone (end padded).
    ids = np.stack([np.concatenate([s1, s2, [0, 0, 0]]), pad(s1), pad(s2)]).astype(np.int32)
    seg = np.stack([[1] * 5 + [2] * 7 + [0] * 3, [1] * 5 + [0] * 10, [3] * 7 + [0] * 8])
    pos = np.stack([list(range(5)) + list(range(7)) + [7, 8, 9], range(15), range(15)])
    call = lambda ids: jforward(  # noqa: E731
        policy,
        jnp.asarray(ids),
        positions=jnp.asarray(pos, jnp.int32),
        segment_ids=jnp.asarray(seg, jnp.int32),
    )
    out = call(ids)
    np.testing.assert_allclose(out.logits[0, :5], out.logits[1, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.logits[0, 5:12], out.logits[2, :7], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.routed_experts[0, 5:12], out.routed_experts[2, :7])
    chex.assert_tree_all_finite(out.logits)
    # Padding tokens (segment 0) change neither real tokens nor the router losses.
    other = ids.copy()
    other[seg == 0] = 17
    out2 = call(other)
    real = seg != 0
    np.testing.assert_allclose(out2.logits[real], out.logits[real], rtol=1e-6, atol=1e-6)
    for k in ("load_balancing_loss", "router_z_loss"):
        np.testing.assert_allclose(out2.aux[k], out.aux[k], rtol=1e-6)


def test_return_logits_false_gives_hidden_for_unembed():
    policy = _policy()
    ids = jnp.asarray(np.random.RandomState(3).randint(0, 64, (2, 6)), jnp.int32)
    full = jforward(policy, ids)
    # Policy.__call__ under nnx.jit (the module API), hidden only.
    slim = nnx.jit(lambda m, x: m(x, return_logits=False))(policy, ids)
    assert slim.logits is None
    chex.assert_shape(policy.unembed(), (32, 64))
    np.testing.assert_allclose(slim.hidden @ policy.unembed(), full.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_chunked_attention_equals_full_attention_fwd_and_grad():
    import dataclasses

    from osworld_jax.model import forward

    policy = _policy()
    params = policy.params()
    ids = jnp.asarray(np.random.RandomState(4).randint(0, 64, (2, 11)), jnp.int32)
    seg = jnp.asarray([[1] * 7 + [2] * 4, [1] * 9 + [0] * 2], jnp.int32)
    pos = jnp.asarray([list(range(7)) + list(range(4)), list(range(11))], jnp.int32)

    def run(runtime):
        def loss(p):
            out = forward(p, CFG, runtime, ids, positions=pos, segment_ids=seg)
            return jnp.mean(out.logits * jnp.cos(out.logits)), out.logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l1, a), g1 = run(RT)
    (l2, b), g2 = run(dataclasses.replace(RT, attention_chunk=4))  # 3 blocks, last one padded
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    chex.assert_trees_all_close(g2, g1, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("s, chunk", [(37, 4), (16, 8), (5, 8)])  # 10 blocks in 5 bands; 2; 1
def test_causal_chunked_attention_equals_full_attention_fwd_and_grad(s, chunk):
    # Packed rows (two segments and padding, one segment): `segment_mask` over token order is
    # causal by index, so the bands may skip every key after their last query.
    from osworld_jax.model.layers import attention, chunked_attention, segment_mask

    rng = np.random.RandomState(s)
    q, k, v = (jnp.asarray(rng.randn(2, s, n, 8), jnp.float32) for n in (4, 2, 2))
    cut = s // 2
    seg = jnp.asarray([[1] * cut + [2] * (s - cut - 1) + [0], [1] * s], jnp.int32)
    mask = segment_mask(seg, jnp.broadcast_to(jnp.arange(s), (2, s)))

    def run(fn):
        def loss(q, k, v):
            out = fn(q, k, v, mask)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (l1, a), g1 = run(attention)
    (l2, b), g2 = run(lambda *x: chunked_attention(*x, chunk, causal=True))
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    chex.assert_trees_all_close(g2, g1, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="queries but"):
        chunked_attention(q, k[:, :-1], v[:, :-1], mask[:, :, :-1], chunk, causal=True)


def test_policy_skips_keys_only_where_its_order_is_the_index(monkeypatch):
    # Default positions: the order is the index, the chunked attention is causal and equals
    # the full one; given per-segment positions it keeps every key (causal off), as before.
    import dataclasses

    from osworld_jax.model import forward, layers

    seen = []
    real = layers.chunked_attention
    monkeypatch.setattr(
        layers, "chunked_attention", lambda *a, causal: seen.append(causal) or real(*a, causal)
    )
    params = _policy().params()
    ids = jnp.asarray(np.random.RandomState(5).randint(0, 64, (2, 11)), jnp.int32)
    seg = jnp.asarray([[1] * 7 + [2] * 4, [1] * 9 + [0] * 2], jnp.int32)
    chunked = dataclasses.replace(RT, attention_chunk=4)
    full = forward(params, CFG, RT, ids, segment_ids=seg).logits
    banded = forward(params, CFG, chunked, ids, segment_ids=seg).logits
    np.testing.assert_allclose(banded, full, rtol=1e-5, atol=1e-5)
    assert seen and all(seen)
    seen.clear()
    pos = jnp.asarray([list(range(7)) + list(range(4)), list(range(11))], jnp.int32)
    forward(params, CFG, chunked, ids, positions=pos, segment_ids=seg)
    assert seen and not any(seen)

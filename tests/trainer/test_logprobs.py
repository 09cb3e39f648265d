"""Chunked token logprobs == the naive full log-softmax gather, values and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from osworld_jax.trainer.logprobs import token_logprobs


def _naive(hidden, w, tokens):
    # Reference: materialise all f32 logits, log-softmax, gather the next token; position 0 is 0.
    logits = jnp.einsum("rth,hv->rtv", hidden, w, preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)[:, :-1]
    zero = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1)


def _inputs(r=3, t=13, h=16, v=37, dtype=jnp.float32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (r, t, h), dtype)
    w = (jax.random.normal(k2, (h, v)) * 0.5).astype(dtype)
    tokens = jax.random.randint(k3, (r, t), 0, v, jnp.int32)
    return hidden, w, tokens


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])
def test_values_match_naive(chunk):
    hidden, w, tokens = _inputs()
    lp, ent = jax.jit(lambda a, b, c: token_logprobs(a, b, c, chunk=chunk))(hidden, w, tokens)
    ref_lp, ref_ent = _naive(hidden, w, tokens)
    chex.assert_shape((lp, ent), tokens.shape)
    chex.assert_trees_all_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(lp) <= 0.0) and np.all(np.asarray(ent) >= -1e-6)


@pytest.mark.parametrize("save_bytes", [0, None])  # recompute the logits / save onehot - p
@pytest.mark.parametrize("chunk", [4, 13])
def test_gradient_matches_naive(chunk, save_bytes):
    hidden, w, tokens = _inputs(seed=1)
    g = jax.random.normal(jax.random.key(7), tokens.shape)  # arbitrary cotangent

    def f(fn):
        return lambda a, b: jnp.sum(g * fn(a, b)[0])

    ours = lambda a, b: token_logprobs(a, b, tokens, chunk=chunk, save_bytes=save_bytes)  # noqa: E731
    got = jax.jit(jax.grad(f(ours), (0, 1)))(hidden, w)
    ref = jax.grad(f(lambda a, b: _naive(a, b, tokens)), (0, 1))(hidden, w)
    chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("save_bytes", [0, None])
def test_bf16_params_give_f32_logprobs_and_grads_in_param_dtype(save_bytes):
    hidden, w, tokens = _inputs(r=4, t=40, h=64, v=300, dtype=jnp.bfloat16, seed=2)
    lp, _ = token_logprobs(hidden, w, tokens, chunk=4)
    ref, _ = _naive(hidden, w, tokens)  # same bf16 inputs, f32 accumulation
    assert lp.dtype == jnp.float32
    chex.assert_trees_all_close(lp, ref, atol=1e-4, rtol=1e-4)
    g = jax.random.normal(jax.random.key(8), tokens.shape)

    def loss(fn):
        return lambda a, b: jnp.sum(g * fn(a, b)[0])

    ours = lambda a, b: token_logprobs(a, b, tokens, chunk=4, save_bytes=save_bytes)  # noqa: E731
    gh, gw = jax.grad(loss(ours), (0, 1))(hidden, w)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    # Against the f32 gradient of the same bf16 inputs: one bf16 rounding of dz (and of the
    # result), so within bf16 precision, ||d - ref|| / ||ref|| ~ 2^-8.
    f32 = lambda a, b: _naive(a, b, tokens)  # noqa: E731
    rh, rw = jax.grad(loss(f32), (0, 1))(hidden.astype(jnp.float32), w.astype(jnp.float32))
    for got, want in ((gh, rh), (gw, rw)):
        err = jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want)
        assert float(err) < 1e-2, float(err)


def test_no_full_vocab_logits_in_compiled_backward():
    # Memory safety: with chunk C, no f32 buffer of R*T*V elements appears in the compiled
    # forward+backward (the naive version has several).
    r, t, h, v, chunk = 2, 64, 8, 512, 8
    hidden, w, tokens = _inputs(r, t, h, v)
    grad = jax.jit(
        jax.grad(
            lambda a, b: token_logprobs(a, b, tokens, chunk=chunk, save_bytes=0)[0].sum(), (0, 1)
        )
    )
    hlo = grad.lower(hidden, w).compile().as_text()
    assert f"f32[{r},{t},{v}]" not in hlo and f"f32[{r},{t - 1},{v}]" not in hlo
    assert f"f32[{r},{chunk},{v}]" in hlo
    naive = jax.jit(jax.grad(lambda a, b: _naive(a, b, tokens)[0].sum(), (0, 1)))
    assert f"f32[{r},{t},{v}]" in naive.lower(hidden, w).compile().as_text()


def test_saved_residual_is_bf16_and_needs_no_f32_vocab_buffer_or_recompute():
    # Save mode with bf16 weights: the only [R, T, V] buffer is the bf16 onehot - p, and the
    # backward runs no logits matmul (only dh and dW).
    r, t, h, v, chunk = 2, 64, 8, 512, 8
    hidden, w, tokens = _inputs(r, t, h, v, dtype=jnp.bfloat16)

    def lowered(save_bytes):
        fn = lambda a, b: token_logprobs(a, b, tokens, chunk=chunk, save_bytes=save_bytes)  # noqa: E731
        return jax.jit(jax.grad(lambda a, b: fn(a, b)[0].sum(), (0, 1))).lower(hidden, w)

    hlo = lowered(None).compile().as_text()
    assert f"f32[{r},{t},{v}]" not in hlo and f"bf16[{r},{t},{v}]" not in hlo
    assert f"bf16[{r},{chunk},{v}]" in hlo  # the saved residual, one buffer per chunk
    # StableHLO before optimisation, save mode (chunks unrolled): one logits dot per chunk in
    # the forward, dh and dW per chunk in the backward; recompute mode (a scan): one dot in the
    # forward body, three (logits again, dh, dW) in the backward body.
    assert lowered(None).as_text().count("stablehlo.dot_general") == 3 * (t // chunk)
    assert lowered(0).as_text().count("stablehlo.dot_general") == 4


def test_softmax_stats_is_one_reduction_and_matches_logsumexp_and_entropy():
    from osworld_jax.trainer.logprobs import softmax_stats

    scale = jnp.asarray([1.0, 30.0, 1e3, 1e-3, 8.0])[:, None, None]
    z = jax.random.normal(jax.random.key(3), (5, 7, 300)) * scale
    z = z.at[2, :, :100].set(-jnp.inf)  # masked logits
    z = z.at[3, 0].set(1e4)  # far from 0: the running max must shift the sums
    lse, ent = jax.jit(softmax_stats)(z)
    logp = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(logp)
    ref_ent = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    chex.assert_trees_all_close(lse, jax.nn.logsumexp(z, axis=-1), rtol=1e-6, atol=1e-5)
    chex.assert_trees_all_close(ent, ref_ent, rtol=1e-4, atol=1e-4)
    chex.assert_tree_all_finite((lse, ent))
    # One pass over z: a single (3-operand) reduction over the vocab axis in the jaxpr.
    jaxpr = jax.make_jaxpr(softmax_stats)(z).jaxpr
    reductions = [e for e in jaxpr.eqns if e.primitive.name.startswith("reduce")]
    assert len(reductions) == 1 and len(reductions[0].invars) == 6, reductions


def _collective_bytes(hlo: str, devices: int) -> dict[str, float]:
    """Bytes one device sends per execution (benchmarks/comm_volume.py's HLO counter)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "comm_volume.py"
    spec = importlib.util.spec_from_file_location("comm_volume", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("comm_volume", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.hlo_collective_bytes(hlo, devices)


@pytest.mark.parametrize("save_bytes", [0, None])
def test_rows_split_over_the_mesh_sum_the_lm_head_gradient_once(save_bytes):
    # 8 rows over data x fsdp x expert = 2 x 2 x 2, 4 chunks: equal to one device, and the
    # compiled step all-reduces dW [H, V] once (2 x 7/8 x its bytes per device), not once per
    # chunk inside the chunk loop (4x that), as the partitioner did on its own.
    from osworld_jax.model import make_mesh

    r, t, h, v, chunk = 8, 16, 16, 37, 4
    hidden, w, tokens = _inputs(r, t, h, v, seed=3)
    g = jax.random.normal(jax.random.key(9), tokens.shape)

    def loss(a, b):
        return jnp.sum(g * token_logprobs(a, b, tokens, chunk=chunk, save_bytes=save_bytes)[0])

    fn = jax.jit(jax.value_and_grad(loss, (0, 1)))
    one = fn(hidden, w)
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert")))
    hidden = jax.device_put(hidden, rows)  # as the trainer lays out its batch
    with jax.set_mesh(mesh):
        eight = fn(hidden, w)
        hlo = fn.lower(hidden, w).compile().as_text()
    chex.assert_trees_all_close(one, eight, atol=1e-5, rtol=1e-5)
    sent = _collective_bytes(hlo, 8).get("all-reduce", 0.0)
    dw_once = 2 * 7 / 8 * h * v * 4
    assert dw_once <= sent < dw_once + 64, (sent, dw_once)  # + the summed loss scalar

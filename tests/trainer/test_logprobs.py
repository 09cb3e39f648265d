"""Chunked token logprobs == the naive full log-softmax gather, values and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.mark.parametrize("chunk", [4, 13])
def test_gradient_matches_naive(chunk):
    hidden, w, tokens = _inputs(seed=1)
    g = jax.random.normal(jax.random.key(7), tokens.shape)  # arbitrary cotangent

    def f(fn):
        return lambda a, b: jnp.sum(g * fn(a, b)[0])

    got = jax.jit(jax.grad(f(lambda a, b: token_logprobs(a, b, tokens, chunk=chunk)), (0, 1)))(
        hidden, w
    )
    ref = jax.grad(f(lambda a, b: _naive(a, b, tokens)), (0, 1))(hidden, w)
    chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)


def test_bf16_params_give_f32_logprobs_and_grads_in_param_dtype():
    hidden, w, tokens = _inputs(dtype=jnp.bfloat16, seed=2)
    lp, _ = token_logprobs(hidden, w, tokens, chunk=4)
    ref, _ = _naive(hidden, w, tokens)  # same bf16 inputs, f32 accumulation
    assert lp.dtype == jnp.float32
    chex.assert_trees_all_close(lp, ref, atol=1e-4, rtol=1e-4)
    gh, gw = jax.grad(lambda a, b: token_logprobs(a, b, tokens, chunk=4)[0].sum(), (0, 1))(
        hidden, w
    )
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


def test_no_full_vocab_logits_in_compiled_backward():
    # Memory safety: with chunk C, no f32 buffer of R*T*V elements appears in the compiled
    # forward+backward (the naive version has several).
    r, t, h, v, chunk = 2, 64, 8, 512, 8
    hidden, w, tokens = _inputs(r, t, h, v)
    grad = jax.jit(
        jax.grad(lambda a, b: token_logprobs(a, b, tokens, chunk=chunk)[0].sum(), (0, 1))
    )
    hlo = grad.lower(hidden, w).compile().as_text()
    assert f"f32[{r},{t},{v}]" not in hlo and f"f32[{r},{t - 1},{v}]" not in hlo
    assert f"f32[{r},{chunk},{v}]" in hlo
    naive = jax.jit(jax.grad(lambda a, b: _naive(a, b, tokens)[0].sum(), (0, 1)))
    assert f"f32[{r},{t},{v}]" in naive.lower(hidden, w).compile().as_text()

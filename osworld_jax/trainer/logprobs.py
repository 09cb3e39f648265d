"""Memory-safe token logprobs: the log-softmax of the taken token, chunked over the sequence.

A 151,936-word vocabulary at 49k-token contexts makes float32 ``[R, T, V]`` logits (and their
gradient) far too large to hold. Here the logits exist one sequence chunk at a time,
``[R, C, V]``, in the forward pass *and* in the backward pass: a ``jax.custom_vjp`` keeps only
the per-position log-normaliser ``lse`` (``[R, T]`` floats) as residual and recomputes each chunk's
logits when differentiating.

Math (per position, logits ``z = h W``, target ``y``):
  ``logp_y = z_y - lse(z)``;  ``d logp_y / d z = onehot(y) - softmax(z)``;
  ``dh = g (onehot(y) - p) W^T``;  ``dW = sum_positions h^T g (onehot(y) - p)``.
Logits and the softmax are float32 whatever the parameter dtype: bf16 log-softmax over 150k
entries loses the small probabilities the policy gradient and the off-policy gate depend on.
The two backward matmuls take ``dz = g (onehot - p)`` rounded to the parameter dtype (f32
accumulation): with bf16 parameters they run as bf16 GEMMs (a float32 ``dz`` would promote
``W`` and both GEMMs to float32) at one bf16 rounding of ``dz``, the precision of the bf16
activations' own gradients.

Two backward strategies, chosen from static shapes (``save_bytes``):
- *save* (``R * T * V * itemsize(W) <= save_bytes``): the forward also writes
  ``q = onehot(y) - p`` in ``W``'s dtype; the backward is two plain GEMMs with the per-position
  cotangent ``g`` applied as a row scale, ``dh = g * (q W^T)``, ``dW = (g h)^T q``: no logits
  are recomputed and no ``[R, T, V]`` elementwise pass runs in the backward;
- *recompute* (otherwise): only ``lse`` is kept and each chunk's logits are recomputed.

Under a mesh (``jax.set_mesh``) whose batch axes split the rows, the head runs per device
(``shard_map`` over those axes; the vocabulary stays with the partitioner): ``save_bytes`` is
weighed against one device's rows, and the lm-head gradient ``dW`` is summed over the chunks
on each device and then once over the devices (float32). Left to the partitioner, the partial
``dW`` of every chunk was all-reduced inside the chunk loop (a float32 ``[H, V]`` per chunk: 4 x
1.24 GB per step for bench-moe's 4 chunks on 2 devices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _chunk_logits(
    h: Float[Array, "R C H"], w: Float[Array, "H V"], temperature: float = 1.0
) -> Float[Array, "R C V"]:
    z = jnp.einsum("rch,hv->rcv", h, w, preferred_element_type=jnp.float32)
    return z if temperature == 1.0 else z / temperature  # SGLang's logits.div_(T), float32


def _to_chunks(x: Array, chunk: int) -> Array:
    """``[R, T, ...] -> [T // chunk, R, chunk, ...]`` (T divides by chunk)."""
    r, t = x.shape[:2]
    x = x.reshape(r, t // chunk, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _from_chunks(x: Array) -> Array:
    """``[N, R, C, ...] -> [R, N * C, ...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def softmax_stats(z: Float[Array, "*B V"]) -> tuple[Float[Array, "*B"], Float[Array, "*B"]]:
    """``(lse, entropy)`` of ``softmax(z)`` over the last axis in one pass over ``z``.

    One variadic reduction carries the online-softmax state ``(m, s, t)`` with
    ``s = sum exp(z - m)`` and ``t = sum exp(z - m) z`` (each element enters as ``(z, 1, z)``,
    ``-inf`` logits as ``(-inf, 1, 0)``;
    two states merge as ``m = max(m1, m2)``, ``s = s1 e1 + s2 e2``, ``t = t1 e1 + t2 e2``,
    ``e_i = exp(m_i - m)``). Then ``lse = m + log s`` and
    ``H = lse - E_p[z] = lse - t / s``. The three separate passes this replaces (max, then
    ``sum exp(z - m)``, then ``sum p z`` after ``lse``) each read the float32 ``[R, C, V]`` block.
    """

    def merge(a, b):
        (m1, s1, t1), (m2, s2, t2) = a, b
        m = jnp.maximum(m1, m2)
        base = jnp.where(jnp.isfinite(m), m, 0.0)  # both -inf (the init): e = 0, not nan
        e1, e2 = jnp.exp(m1 - base), jnp.exp(m2 - base)
        return m, s1 * e1 + s2 * e2, t1 * e1 + t2 * e2

    z = z.astype(jnp.float32)
    init = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.float32(0))
    zt = jnp.where(jnp.isfinite(z), z, 0.0)  # a -inf logit adds e = 0 to t, not 0 * -inf
    m, s, t = jax.lax.reduce((z, jnp.ones_like(z), zt), init, merge, (z.ndim - 1,))
    lse = m + jnp.log(s)
    return lse, lse - t / s


def _forward(hidden, w, targets, chunk, temperature):
    def body(_, xs):
        h, y = xs  # [R, C, H], [R, C]
        z = _chunk_logits(h, w, temperature)  # [R, C, V] f32
        lse, entropy = softmax_stats(z)  # [R, C] x 2
        z_y = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]  # [R, C]
        return None, (z_y - lse, entropy, lse)

    _, (lp, ent, lse) = jax.lax.scan(
        body, None, (_to_chunks(hidden, chunk), _to_chunks(targets, chunk))
    )
    return _from_chunks(lp), _from_chunks(ent), _from_chunks(lse)


def _onehot_minus_p(z, lse, y, dtype):
    """``onehot(y) - exp(z - lse)`` in ``dtype``: [R, C, V]."""
    p = jnp.exp(z - lse[..., None])
    onehot = jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == y[..., None]
    return (onehot.astype(jnp.float32) - p).astype(dtype)


def _forward_saving(hidden, w, targets, chunk, temperature):
    """`_forward` that also returns ``q = onehot - p`` in ``w.dtype``, one [R, C, V] per chunk.

    The chunks run as an unrolled Python loop (the saved residual is bounded by ``save_bytes``,
    so there are few of them): each ``q`` chunk is its own buffer, so no stacked ``[N, R, C, V]``
    scan output is zero-initialised, written slice by slice, and transposed back.
    """
    lps, ents, qs = [], [], []
    for i in range(hidden.shape[1] // chunk):
        h, y = hidden[:, i * chunk : (i + 1) * chunk], targets[:, i * chunk : (i + 1) * chunk]
        z = _chunk_logits(h, w, temperature)  # [R, C, V] f32
        lse, entropy = softmax_stats(z)  # one pass over z
        z_y = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
        lps.append(z_y - lse)
        ents.append(entropy)
        qs.append(_onehot_minus_p(z, lse, y, w.dtype))  # the second (and last) pass
    return jnp.concatenate(lps, axis=1), jnp.concatenate(ents, axis=1), tuple(qs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_logprobs(hidden, w, targets, chunk, save, temperature, axes=()):
    lp, ent, _ = _forward(hidden, w, targets, chunk, temperature)
    return lp, ent


def _chunked_logprobs_fwd(hidden, w, targets, chunk, save, temperature, axes=()):
    if save:
        lp, ent, q = _forward_saving(hidden, w, targets, chunk, temperature)
        return (lp, ent), (hidden, w, None, q)
    lp, ent, lse = _forward(hidden, w, targets, chunk, temperature)
    return (lp, ent), (hidden, w, targets, lse)


def _chunked_logprobs_bwd(chunk, save, temperature, axes, residuals, cotangents):
    """Cotangents of ``hidden`` and ``w`` (and none of ``targets``).

    With ``axes`` (inside a ``shard_map`` over the rows) this device's float32 ``dW``, summed
    over its chunks, is then summed over ``axes`` once.
    """
    hidden, w, targets, saved = residuals
    g_lp, _ = cotangents  # the entropy output is a metric: its cotangent is ignored (see below)
    g_lp = g_lp.astype(jnp.float32)
    if temperature != 1.0:  # z = h W / T: every d/dh, d/dW carries 1/T, as g does
        g_lp = g_lp / temperature
    if save:  # saved q = onehot - p, per chunk: two GEMMs each, g as a row scale
        gh = (g_lp[..., None] * hidden.astype(jnp.float32)).astype(w.dtype)  # [R, T, H]
        dhs, dw = [], jnp.zeros(w.shape, jnp.float32)
        for i, q in enumerate(saved):  # q: [R, C, V]
            cols = slice(i * chunk, (i + 1) * chunk)
            dh = jnp.einsum("rcv,hv->rch", q, w, preferred_element_type=jnp.float32)
            dhs.append((g_lp[:, cols, None] * dh).astype(hidden.dtype))
            dw = dw + jnp.einsum("rch,rcv->hv", gh[:, cols], q, preferred_element_type=jnp.float32)
        dw = jax.lax.psum(dw, axes) if axes else dw
        return jnp.concatenate(dhs, axis=1), dw.astype(w.dtype), None
    vocab = w.shape[-1]

    def body(dw, xs):
        h, y, lse_c, g = xs  # [R, C, H], [R, C], [R, C], [R, C]
        z = _chunk_logits(h, w, temperature)  # [R, C, V] f32, recomputed
        dz = (g[..., None] * _onehot_minus_p(z, lse_c, y, jnp.float32)).astype(w.dtype)
        dh = jnp.einsum("rcv,hv->rch", dz, w, preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum("rch,rcv->hv", h, dz, preferred_element_type=jnp.float32)
        return dw, dh.astype(hidden.dtype)

    xs = tuple(_to_chunks(x, chunk) for x in (hidden, targets, saved, g_lp))
    dw0 = jnp.zeros((w.shape[0], vocab), jnp.float32)
    if axes:  # the carry varies over the rows' devices like the per-chunk dW added to it
        dw0 = jax.lax.pcast(dw0, axes, to="varying")
    dw, dh = jax.lax.scan(body, dw0, xs)
    dw = jax.lax.psum(dw, axes) if axes else dw
    return _from_chunks(dh), dw.astype(w.dtype), None


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)


# Default cap of the saved ``onehot - p`` residual (bytes, per call): about 5 GB for 16k
# positions of a 152k vocabulary in bf16.
DEFAULT_SAVE_BYTES = 8 << 30


def saves_probs(rows: int, positions: int, vocab: int, dtype, save_bytes: int | None) -> bool:
    """Whether `token_logprobs` keeps ``onehot - p`` for its backward (see module doc)."""
    limit = DEFAULT_SAVE_BYTES if save_bytes is None else save_bytes
    return rows * positions * vocab * jnp.dtype(dtype).itemsize <= limit


def _row_axes(rows: int, batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The ambient mesh's ``batch_axes`` (size > 1, not manual) when they divide ``rows``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(
        a
        for a in batch_axes
        if a in mesh.axis_names and a not in mesh.manual_axes and mesh.shape[a] > 1
    )
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return axes if axes and rows % size == 0 else ()


def token_logprobs(
    hidden: Float[Array, "R T H"],
    unembed: Float[Array, "H V"],
    tokens: Int[Array, "R T"],
    *,
    chunk: int = 1024,
    save_bytes: int | None = None,
    temperature: float = 1.0,
    batch_axes: tuple[str, ...] = ("data", "fsdp", "expert"),
) -> tuple[Float[Array, "R T"], Float[Array, "R T"]]:
    """Logprob of each token under the logits of the previous position, and the entropy there.

    ``out[r, t] = log softmax(hidden[r, t-1] @ unembed / temperature)[tokens[r, t]]`` for
    ``t >= 1`` and ``out[r, 0] = 0`` (position 0 has no prediction and is never trainable),
    i.e. aligned to ``tokens`` as the ``Batch`` contract requires. ``entropy[r, t]`` is the
    entropy of that same predictive distribution, ``H = lse(z) - sum softmax(z) z`` (0 at
    ``t = 0``).

    The sequence is processed ``chunk`` positions at a time (via a ``custom_vjp``), so at most
    one float32 ``[R, chunk, V]`` logit block exists at a time; the sequence is padded up to a
    multiple of ``chunk``. When differentiated, the backward either reuses a saved
    ``onehot - p`` in ``unembed``'s dtype (``[R, T, V]``, when it fits in ``save_bytes``) or
    recomputes the logits chunk by chunk (see the module doc). Gradients flow to ``hidden`` and
    ``unembed`` through the logprobs only: the entropy is a stop-gradient metric.

    Args:
      hidden: [R, T, H] final normed hidden states (any float dtype).
      unembed: [H, V] output projection (lm head, or the embedding transposed when tied).
      tokens: i32[R, T] token ids.
      chunk: sequence positions per chunk.
      save_bytes: most bytes the saved ``onehot - p`` residual may take per device (None:
        `DEFAULT_SAVE_BYTES`; 0: always recompute).
      temperature: the logits are ``hidden @ unembed / temperature`` (float32, as SGLang's
        sampler divides them): logprobs and entropy of the tempered distribution, the one the
        rollout engine's logprobs refer to (``rollout.logprob_temperature``). Static.
      batch_axes: mesh axes the rows are split over under an ambient mesh (module doc).

    Returns:
      ``(logprobs, entropy)``, both f32[R, T].
    """
    r, t, _ = hidden.shape
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((r, 1), tokens.dtype)], axis=1)
    chunk = min(chunk, t)
    pad = -t % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    axes = _row_axes(r, batch_axes)
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1
    for a in axes:
        shards *= mesh.shape[a]
    save = saves_probs(r // shards, hidden.shape[1], unembed.shape[-1], unembed.dtype, save_bytes)

    def head(h: jax.Array, w: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _chunked_logprobs(h, w, y, chunk, save, float(temperature), axes)

    if axes:  # per device; dW summed over `axes` once, in float32, by the backward
        rows = jax.sharding.PartitionSpec(axes)
        head = jax.shard_map(
            head,
            mesh=mesh,
            in_specs=(rows, jax.sharding.PartitionSpec(), rows),
            out_specs=(rows, rows),
            axis_names=frozenset(axes),
        )
    lp, ent = head(hidden, unembed, targets.astype(jnp.int32))
    zero = jnp.zeros((r, 1), jnp.float32)
    lp = jnp.concatenate([zero, lp[:, : t - 1]], axis=1)
    ent = jnp.concatenate([zero, jax.lax.stop_gradient(ent[:, : t - 1])], axis=1)
    return lp, ent

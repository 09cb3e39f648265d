"""The sparse MoE MLP: route -> (replay) -> permute -> expert compute -> unpermute.

Routing is HF Qwen3-MoE's: ``p = softmax(x @ W_router)`` in float32 over **all** E experts,
the top-k of ``p``, then (``norm_topk_prob``) ``w = p_topk / sum(p_topk)``.

Router replay (R3, arXiv 2510.11370): a replayed row ``r`` of K expert ids replaces the top-k
*indices* only; the gates are recomputed from this model's probabilities,
``w = p[r] / sum(p[r])`` (or ``p[r]`` without renormalisation), so the router keeps its gradient.
A row of all -1 routes live. Rows are validated on the host (`osworld_jax.model.replay`).

Expert backends (registry `EXPERT_BACKENDS`) all compute
``y_t = sum_k w_tk * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = experts[t, k]``; no
token is ever dropped. An expert id of ``-1`` marks a (token, k) slot that is not computed by
this call (it contributes zero): expert parallelism (`osworld_jax.model.expert_parallel`) calls
a backend on one device's experts with the other devices' slots set to ``-1``. ``"auto"`` (the
default) picks one per platform at trace time (`auto_expert_backend`): the Pallas grouped
matmuls on a GPU, ``ragged_dot`` on TPU and CPU.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from osworld_jax.registry import Registry

ExpertFn = Callable[..., jax.Array]
EXPERT_BACKENDS: Registry[ExpertFn] = Registry("expert backend")


class Routing(NamedTuple):
    """The result of routing T tokens.

    Attributes:
      experts: i32[T, K] experts used (replayed where a replay row was given, else live).
      weights: f32[T, K] gate weights of ``experts`` (differentiable w.r.t. the router).
      live_experts: i32[T, K] this model's own top-k (used by the load-balancing loss).
      probs: f32[T, E] softmax of the router logits.
      logits: f32[T, E] router logits.
    """

    experts: jax.Array
    weights: jax.Array
    live_experts: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(
    x: Float[Array, "T H"],
    router: Float[Array, "H E"],
    *,
    top_k: int,
    norm_topk_prob: bool,
    replay: Int[Array, "T K"] | None = None,
) -> Routing:
    """HF Qwen3-MoE top-k routing in float32, with optional R3 replay of the indices."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    _, live = jax.lax.top_k(probs, top_k)  # [T, K]
    experts = live
    if replay is not None:
        use_live = jnp.all(replay < 0, axis=-1, keepdims=True)  # [T, 1]
        experts = jnp.where(use_live, live, replay.astype(live.dtype))  # [T, K]
    weights = jnp.take_along_axis(probs, experts, axis=-1)  # [T, K]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts, weights, live, probs, logits)


def router_stats(
    routing: Routing, valid: Float[Array, " T"]
) -> tuple[Float[Array, " E"], Float[Array, " E"], Float[Array, ""]]:
    """Per-layer sums HF's load-balancing loss accumulates over layers.

    Returns:
      (count f32[E] of live top-k assignments of valid tokens, prob_sum f32[E] of the router
      probabilities of valid tokens, z_sum: sum over valid tokens of logsumexp(logits)^2).
    """
    num_experts = routing.probs.shape[-1]
    onehot = jax.nn.one_hot(routing.live_experts, num_experts, dtype=jnp.float32)  # [T, K, E]
    count = jnp.einsum("tke,t->e", jax.lax.stop_gradient(onehot), valid)  # [E]
    prob_sum = jnp.einsum("te,t->e", routing.probs, valid)  # [E]
    z = jax.nn.logsumexp(routing.logits, axis=-1)  # [T]
    return count, prob_sum, jnp.sum(valid * z * z)


def replay_agreement(
    routing: Routing, replay: Int[Array, "T K"] | None, valid: Float[Array, " T"]
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """R3 route agreement counts of one layer: replayed routes equal to this model's own top-k.

    A token counts as replayed when it is valid and its replay row is a route (no -1); it agrees
    when the replayed expert *set* equals ``routing.live_experts`` (the top-k of this model's
    router on the same input, computed anyway). Both are stop-gradient counts.

    Returns:
      ``(agreeing f32[], replayed f32[])`` token counts.
    """
    if replay is None:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero
    replayed = jnp.all(replay >= 0, axis=-1) & (valid > 0)  # [T]
    same = jnp.all(jnp.sort(replay, axis=-1) == jnp.sort(routing.live_experts, axis=-1), -1)
    agreeing = jnp.sum((replayed & same).astype(jnp.float32))
    return jax.lax.stop_gradient(agreeing), jnp.sum(replayed.astype(jnp.float32))


def load_balancing_loss(count: jax.Array, prob_sum: jax.Array, rows: jax.Array) -> jax.Array:
    r"""HF's Switch-Transformer loss over all MoE layers' valid rows.

    ``E * sum_e (count_e / rows) * (prob_sum_e / rows)`` where count/prob_sum/rows are summed
    over layers (transformers ``load_balancing_loss_func`` with an attention mask).
    """
    rows = jnp.maximum(rows, 1.0)
    return count.shape[-1] * jnp.sum((count / rows) * (prob_sum / rows))


def _swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    return jax.nn.silu(g) * u


@EXPERT_BACKENDS.register("dense")
def dense_experts(
    x: Float[Array, "T H"],
    experts: Int[Array, "T K"],
    weights: Float[Array, "T K"],
    gate: Float[Array, "E H I"],
    up: Float[Array, "E H I"],
    down: Float[Array, "E I H"],
) -> Float[Array, "T H"]:
    """Every expert on every token, combined with the (mostly zero) gate matrix: the reference."""
    num_experts = gate.shape[0]
    combine = jnp.einsum(  # [T, E]
        "tk,tke->te", weights, jax.nn.one_hot(experts, num_experts, dtype=weights.dtype)
    )
    h = _swiglu(jnp.einsum("th,ehi->tei", x, gate), jnp.einsum("th,ehi->tei", x, up))  # [T,E,I]
    y = jnp.einsum("tei,eih->teh", h, down)  # [T, E, H]
    return jnp.einsum("teh,te->th", y, combine.astype(y.dtype))  # [T, H]


class _Permutation(NamedTuple):
    order: jax.Array  # i32[T*K]: sorted slot -> flat (token, k) slot
    inverse: jax.Array  # i32[T*K]: flat slot -> sorted slot
    group_sizes: jax.Array  # i32[E]


def _permute(experts: Int[Array, "T K"], num_experts: int) -> _Permutation:
    """Stable sort of the T*K slots by expert; ``-1`` slots (not computed here) sort last.

    ``group_sizes`` counts only the E real groups, so the grouped matmul leaves the trailing
    ``-1`` rows out (``ragged_dot`` gives zero rows past the last group).
    """
    flat = experts.reshape(-1)  # [T*K]
    key = jnp.where(flat < 0, num_experts, flat)  # [T*K]
    order = jnp.argsort(key, stable=True)  # [T*K]
    inverse = jnp.argsort(order)  # [T*K]
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)  # [E]
    return _Permutation(order, inverse, sizes)


def _grouped_experts(
    matmul: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """Sort token copies by expert, grouped matmuls, unsort, weighted sum over k."""
    num_tokens, top_k = experts.shape
    perm = _permute(experts, gate.shape[0])
    xs = x[perm.order // top_k]  # [T*K, H] sorted by expert
    h = _swiglu(matmul(xs, gate, perm.group_sizes), matmul(xs, up, perm.group_sizes))  # [T*K, I]
    ys = matmul(h, down, perm.group_sizes)  # [T*K, H]
    y = ys[perm.inverse].reshape(num_tokens, top_k, -1)  # [T, K, H]
    return jnp.einsum("tkh,tk->th", y, weights.astype(y.dtype))  # [T, H]


_RAGGED_GPU_WARNED = False


@EXPERT_BACKENDS.register("ragged")
def ragged_experts(x, experts, weights, gate, up, down):
    """Sort by expert + ``jax.lax.ragged_dot`` (CPU/TPU).

    On a GPU XLA expands ``ragged_dot`` into a dense masked matmul whose buffer grows with
    ``routed rows x experts x hidden`` (a 128 GiB request was seen for 20k tokens of a
    128-expert layer on an H200), so tracing it there warns once, naming ``"auto"``.
    """
    global _RAGGED_GPU_WARNED
    if jax.default_backend() == "gpu" and not _RAGGED_GPU_WARNED:
        _RAGGED_GPU_WARNED = True
        warnings.warn(
            "expert_backend='ragged' on a GPU runs a dense masked matmul (memory ~ routed rows x "
            "experts x hidden); use expert_backend='auto' (the Pallas grouped matmul, "
            "'pallas_gmm_mosaic' on Hopper, 'pallas_gmm' elsewhere)",
            RuntimeWarning,
            stacklevel=2,
        )

    def matmul(lhs, rhs, sizes):
        return jax.lax.ragged_dot(lhs, rhs, sizes)

    return _grouped_experts(matmul, x, experts, weights, gate, up, down)


@EXPERT_BACKENDS.register("tokamax")
def tokamax_experts(x, experts, weights, gate, up, down):
    """Sort by expert + ``tokamax.ragged_dot`` (Pallas Mosaic-GPU kernel for Hopper).

    Seen on an H200 with jax 0.11.2 (2026-11-30): the PyPI tokamax 0.0.10-0.0.12 kernels fail
    there (Mosaic: ``plgpu.kernel`` now takes ``out_type``, not ``out_shape``; Triton: ``pl.dot``
    was removed), so this backend needs a tokamax built against that jax.
    """
    try:
        import tokamax  # type: ignore[import-not-found]
    except ImportError as e:  # pragma: no cover - GPU installs only
        raise ImportError(
            "expert_backend='tokamax' needs the tokamax package (pip install 'osworld_jax[gpu]')"
        ) from e

    def matmul(lhs, rhs, sizes):
        return tokamax.ragged_dot(lhs, rhs, group_sizes=sizes)

    return _grouped_experts(matmul, x, experts, weights, gate, up, down)


@EXPERT_BACKENDS.register("pallas_gmm")
def pallas_gmm_experts(x, experts, weights, gate, up, down):
    """Tile-aligned sort + Pallas grouped matmuls (Triton on GPU, interpret mode on CPU)."""
    from osworld_jax.model.kernels import grouped_matmul

    return grouped_matmul.gmm_experts(x, experts, weights, gate, up, down)


@EXPERT_BACKENDS.register("pallas_gmm_mosaic")
def pallas_gmm_mosaic_experts(x, experts, weights, gate, up, down):
    """As ``pallas_gmm`` with the Mosaic GPU (TMA + wgmma) kernels on Hopper.

    Inside expert parallelism the forward/dx kernels skip the unused tiles of the worst-case
    buffer (`MosaicConfig.skip_unused_tiles`).
    """
    from osworld_jax.model.expert_parallel import inside_expert_parallel
    from osworld_jax.model.kernels import grouped_matmul

    config = grouped_matmul.MOSAIC_CONFIG
    if inside_expert_parallel():
        mosaic = dataclasses.replace(config.mosaic, skip_unused_tiles=True)
        config = dataclasses.replace(config, mosaic=mosaic)
    return grouped_matmul.gmm_experts(x, experts, weights, gate, up, down, config=config)


def auto_expert_backend(dtype: jnp.dtype | str, platform: str | None = None) -> str:
    """The backend ``"auto"`` resolves to for ``dtype`` on ``platform`` (default: JAX's).

    - GPU: the Pallas grouped matmuls: ``"pallas_gmm_mosaic"`` (TMA + wgmma forward, the
      measured-best kernel per part, `grouped_matmul.MOSAIC_CONFIG`) on Hopper (compute
      capability 9.x) with 16-bit weights, else ``"pallas_gmm"`` (Triton, any CUDA GPU/dtype).
      Under expert parallelism both skip the unused tiles of a device's worst-case buffer;
    - TPU: ``"ragged"`` (``ragged_dot`` lowers to the TPU's grouped matmul);
    - CPU: ``"ragged"`` (XLA's masked fallback; fine at test sizes).
    """
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        kind = str(getattr(jax.devices()[0], "compute_capability", ""))
        hopper = platform != "rocm" and kind.startswith("9")
        if hopper and jnp.dtype(dtype).itemsize == 2:
            return "pallas_gmm_mosaic"
        return "pallas_gmm"
    return "ragged"


@EXPERT_BACKENDS.register("auto")
def auto_experts(x, experts, weights, gate, up, down):
    """The platform's best backend (`auto_expert_backend`), resolved when traced."""
    fn = EXPERT_BACKENDS.get(auto_expert_backend(gate.dtype))
    return fn(x, experts, weights, gate, up, down)


def swiglu_mlp(
    x: Float[Array, "T H"],
    gate: Float[Array, "H F"],
    up: Float[Array, "H F"],
    down: Float[Array, "F H"],
) -> Float[Array, "T H"]:
    """The dense SwiGLU MLP of ``mlp_only_layers``: ``down(silu(gate x) * up x)``."""
    return _swiglu(x @ gate, x @ up) @ down

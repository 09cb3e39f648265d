"""Token sampling for the embedded server: pure, jitted, batched over request slots.

SGLang semantics (0.5.23: ``sglang/srt/layers/sampler.py`` ``Sampler.forward``,
``sglang/srt/sampling/sampling_params.py`` ``SamplingParams.__post_init__``; see
docs/INTERFACES.md, rollout):
- the returned logprob of a sampled token is ``log_softmax(logits / T_lp)`` over the full
  vocabulary, taken *before* top-k / top-p / min-p filtering (never renormalised), where
  ``T_lp`` is the request's temperature, or 1 when the server returns original logprobs
  (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``); `osworld_jax.contract.sampling.logprob_temperature`
  is the rule;
- ``temperature < 1e-6`` is greedy and is normalised on the host to ``T = 1, top_k = 1``, so
  greedy requests report temperature-1 logprobs;
- filters act on the sorted, unrenormalised probabilities: keep rank ``< top_k``, keep a token if
  the mass strictly before it is ``<= top_p``, keep ``p >= min_p * p_max``; the top token always
  survives; then sample from the kept tokens in proportion to their probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

_NEG_INF = -jnp.inf


#: Banned-token columns per slot (EOS + stop ids suppressed before ``min_new_tokens``).
MAX_BANNED = 16


def _filter_mask(
    logprobs: Float[Array, "B V"],
    top_p: Float[Array, " B"],
    top_k: Int[Array, " B"],
    min_p: Float[Array, " B"],
) -> jax.Array:
    """Bool[B, V]: tokens that survive top-k, top-p and min-p."""
    b, v = logprobs.shape
    order = jnp.argsort(-logprobs, axis=-1, stable=True)  # [B, V] token ids by rank
    sorted_p = jnp.exp(jnp.take_along_axis(logprobs, order, axis=-1))  # [B, V]
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each rank
    rank = jnp.arange(v)[None, :]
    keep = (rank < top_k[:, None]) & (before <= top_p[:, None])
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep = keep.at[:, 0].set(True)
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, v), bool).at[rows, order].set(keep)


def sample(
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_p: Float[Array, " B"],
    top_k: Int[Array, " B"],
    min_p: Float[Array, " B"],
    banned: Int[Array, "B M"],
    keys: UInt32[Array, "B 2"],
    logprob_temperature: Float[Array, " B"],
    num_top: int = 0,
) -> tuple[Int[Array, " B"], Float[Array, " B"], Int[Array, "B k"], Float[Array, "B k"]]:
    """Samples one token per row, with its logprob and the top logprobs of its distribution.

    Returns (token ids i32[B], their logprobs f32[B], top ids i32[B, num_top], top logprobs
    f32[B, num_top]).

    ``token ~ softmax(logits / T)`` restricted to the filter's survivors, and the reported
    logprob is ``log_softmax(logits / T_lp)[token]`` over the whole vocabulary (``T_lp`` =
    ``logprob_temperature``; the scaled distribution is reused when ``T_lp == T`` on every row).

    Args:
      logits: f32[B, V] next-token logits.
      temperature: f32[B] (> 0; greedy rows arrive as T = 1, top_k = 1).
      top_p: f32[B] in (0, 1].
      top_k: i32[B] (>= V keeps everything).
      min_p: f32[B] in [0, 1].
      banned: i32[B, M] token ids whose logits are -inf for this step (``min_new_tokens``
        suppression of EOS / stop ids, like SGLang's penalizer: it changes the logprobs too);
        entries ``>= V`` are ignored.
      keys: u32[B, 2] per-row PRNG keys (already folded with the step).
      logprob_temperature: f32[B] temperature of the reported logprobs (``T`` by default, 1
        for original logprobs).
      num_top: (static) how many of the most likely tokens of the reported distribution to
        return with their logprobs (SGLang's ``top_logprobs_num``), best first; 0 for none.
    """
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    logits = logits.astype(jnp.float32).at[rows, banned].set(_NEG_INF, mode="drop")
    logprobs = jax.nn.log_softmax(logits / temperature[:, None], axis=-1)  # [B, V] float32
    needs_filter = jnp.any(top_k < v) | jnp.any(top_p < 1.0) | jnp.any(min_p > 0.0)
    keep = jax.lax.cond(
        needs_filter,
        lambda: _filter_mask(logprobs, top_p, top_k, min_p),
        lambda: jnp.ones((b, v), bool),
    )
    masked = jnp.where(keep, logprobs, _NEG_INF)
    tokens = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)  # [B]
    reported = jax.lax.cond(
        jnp.all(logprob_temperature == temperature),
        lambda: logprobs,
        lambda: jax.nn.log_softmax(logits / logprob_temperature[:, None], axis=-1),
    )  # [B, V] float32
    top_lps, top_ids = jax.lax.top_k(reported, num_top)  # [B, k] each, best first
    chosen = jnp.take_along_axis(reported, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen, top_ids.astype(jnp.int32), top_lps


def step_keys(base: UInt32[Array, "B 2"], step: Int[Array, " B"]) -> UInt32[Array, "B 2"]:
    """Per-row keys for this step: ``fold_in(base_key_of_request, tokens_generated_so_far)``."""
    return jax.vmap(jax.random.fold_in)(base, step)


def token_logprobs(logits: Float[Array, "S V"], targets: Int[Array, " S"]) -> Float[Array, " S"]:
    """``log_softmax(logits)[s, targets[s]]`` at temperature 1 (SGLang's prompt logprobs)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]


def top_logprobs(
    logits: Float[Array, "S V"], k: int
) -> tuple[Int[Array, "S k"], Float[Array, "S k"]]:
    """The ``k`` most likely tokens of ``log_softmax(logits)`` per row (best first)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(lp, k)
    return ids.astype(jnp.int32), values


@dataclass(frozen=True)
class SlotSampling:
    """Per-slot sampling arrays of one step (host numpy, one row per slot).

    Attributes:
      temperature: f32[b]; top_p: f32[b]; top_k: i32[b]; min_p: f32[b];
      banned: i32[b, MAX_BANNED] (vocab size = unused); keys: u32[b, 2] per-request base keys;
      step: i32[b] tokens generated so far (folded into the key).
      logprob_temperature: f32[b] temperature of the reported logprobs (see `sample`).
    """

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    banned: np.ndarray
    keys: np.ndarray
    step: np.ndarray
    logprob_temperature: np.ndarray


def dummy_sampling(rows: int, vocab: int) -> SlotSampling:
    """Neutral sampling arrays of ``rows`` rows (warm-up and the memory plan's programs)."""
    return SlotSampling(
        temperature=np.ones(rows, np.float32),
        top_p=np.ones(rows, np.float32),
        top_k=np.full(rows, vocab, np.int32),
        min_p=np.zeros(rows, np.float32),
        banned=np.full((rows, MAX_BANNED), vocab, np.int32),
        keys=np.zeros((rows, 2), np.uint32),
        step=np.zeros(rows, np.int32),
        logprob_temperature=np.ones(rows, np.float32),
    )

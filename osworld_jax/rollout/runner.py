"""The embedded server's model runner: the trainer's own `forward`, a slot KV cache, buckets.

Shapes are bucketed so that serving never recompiles per request: a prefill runs one request
padded to a power-of-two length ``S`` over its slot's first ``S`` cache rows; a decode step runs
the first ``b`` slots (``b`` a power of two covering every live slot) over the first ``Lb`` cache
rows (``Lb`` a power of two covering every live position). Each (S) and (b, Lb) compiles once.
Parameters are a jit *argument*, so a refit swaps them without recompiling.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from osworld_jax.model import (
    KVCache,
    ModelRuntimeConfig,
    Qwen3MoeConfig,
    forward,
    init_kv_cache,
    load_hf_checkpoint,
    unembed_matrix,
)
from osworld_jax.rollout.errors import EngineError
from osworld_jax.rollout.sampling import sample, step_keys, token_logprobs

log = logging.getLogger(__name__)

#: Banned-token columns per slot (EOS + stop ids suppressed before ``min_new_tokens``).
MAX_BANNED = 16


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)``."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def _logits(params: Any, hidden: jax.Array, config: Qwen3MoeConfig) -> jax.Array:
    # The same einsum as `forward`'s logits, so float32 results match the trainer exactly.
    return jnp.einsum(
        "...h,hv->...v",
        hidden,
        unembed_matrix(params, config),
        preferred_element_type=jnp.float32,
    )


def _sample(params: Any, hidden: jax.Array, samp: dict[str, jax.Array], config: Qwen3MoeConfig):
    return sample(
        _logits(params, hidden, config),
        samp["temperature"],
        samp["top_p"],
        samp["top_k"],
        samp["min_p"],
        samp["banned"],
        step_keys(samp["keys"], samp["step"]),
        samp["logprob_temperature"],
    )


# Module-level jits with the (hashable, frozen) configs static: every runner of the same
# architecture in a process shares the compiled buckets.
@functools.partial(jax.jit, static_argnames=("config", "runtime"), donate_argnames=("cache",))
def _prefill(params, cache, slots, tokens, lengths, samp, *, config, runtime):
    p, s = tokens.shape
    # A prefill writes every position in [0, S) of its rows (padding sits past `length`) and
    # attends only to j <= position < S, so it starts from a zero cache and never reads the
    # slots' stale contents.
    shape = (cache.k.shape[0], p, s, *cache.k.shape[3:])
    sub = KVCache(jnp.zeros(shape, cache.k.dtype), jnp.zeros(shape, cache.v.dtype))
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))  # [P, S]
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
    out = forward(
        params,
        config,
        runtime,
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        kv_cache=sub,
        return_logits=False,
    )
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [P, H]
    tok, lp = _sample(params, last, samp, config)
    # Padding rows carry slot index num_slots: their writes drop.
    new_k = cache.k.at[:, slots, :s].set(out.kv_cache.k, mode="drop")
    new_v = cache.v.at[:, slots, :s].set(out.kv_cache.v, mode="drop")
    return tok, lp, out.routed_experts, out.hidden, KVCache(new_k, new_v)


@functools.partial(
    jax.jit, static_argnames=("config", "runtime", "attn_len"), donate_argnames=("cache",)
)
def _decode(params, cache, tokens, positions, active, samp, *, config, runtime, attn_len):
    b = tokens.shape[0]
    sub = KVCache(cache.k[:, :b, :attn_len], cache.v[:, :b, :attn_len])  # [L, b, Lb, KV, D]
    out = forward(
        params,
        config,
        runtime,
        tokens[:, None],
        positions=positions[:, None],
        segment_ids=active[:, None],
        kv_cache=sub,
        return_logits=False,
    )
    tok, lp = _sample(params, out.hidden[:, 0], samp, config)
    new_k = jax.lax.dynamic_update_slice(cache.k, out.kv_cache.k, (0, 0, 0, 0, 0))
    new_v = jax.lax.dynamic_update_slice(cache.v, out.kv_cache.v, (0, 0, 0, 0, 0))
    return tok, lp, out.routed_experts[:, 0], KVCache(new_k, new_v)


@functools.partial(jax.jit, static_argnames=("config",))
def _prompt_logprobs(params, hidden, targets, *, config):
    s = hidden.shape[0]
    chunk = min(s, 256)
    hs = hidden.reshape(s // chunk, chunk, -1)
    ts = targets.reshape(s // chunk, chunk)
    lps = jax.lax.map(lambda a: token_logprobs(_logits(params, a[0], config), a[1]), (hs, ts))
    return lps.reshape(s)


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


def _dummy_sampling(rows: int, vocab: int) -> SlotSampling:
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


class ModelRunner:
    """Owns the parameters and the KV cache; runs bucketed prefill and decode steps.

    Args:
      model_path: HF checkpoint directory (config.json + safetensors).
      num_slots: concurrent requests (``--max-running-requests``); rounded up to a power of two.
      slot_len: tokens per slot (the context length); rounded up to a power of two.
      dtype: "float32" or "bfloat16" (parameters, activations and KV cache).
      expert_backend: the model's expert backend ("auto", "dense", "ragged", ...).
      min_bucket: smallest prefill / attention-length bucket.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        num_slots: int,
        slot_len: int,
        dtype: str = "float32",
        expert_backend: str = "auto",
        min_bucket: int = 16,
    ) -> None:
        self.runtime = ModelRuntimeConfig(expert_backend=expert_backend, dtype=dtype)
        policy = load_hf_checkpoint(model_path, runtime=self.runtime)
        self.config: Qwen3MoeConfig = policy.config
        self.params = policy.params()
        self.num_slots = next_pow2(num_slots)
        self.slot_len = next_pow2(slot_len, min_bucket)
        self.min_bucket = min_bucket
        self.vocab_size = self.config.vocab_size
        # Committed to the parameters' device, like every later (donated, returned) cache:
        # an uncommitted first cache would compile each bucket twice.
        device = jax.tree.leaves(self.params)[0].sharding
        self.cache: KVCache = jax.device_put(
            init_kv_cache(self.config, self.num_slots, self.slot_len, jnp.dtype(dtype)), device
        )

    # ----------------------------------------------------------------- weights

    def load_weights(self, model_path: str | Path) -> None:
        """Replaces the parameters with those of ``model_path`` (same architecture required)."""
        policy = load_hf_checkpoint(model_path, runtime=self.runtime)
        if policy.config != self.config:
            raise EngineError(
                f"{model_path}: config.json differs from the served model's; a refit must keep "
                "the architecture"
            )
        new = policy.params()
        for group, values in new.items():
            for name, v in values.items():
                old = self.params[group][name]
                if v.shape != old.shape or v.dtype != old.dtype:
                    raise EngineError(f"{model_path}: {group}.{name} {v.shape} != {old.shape}")
        self.params = new

    # ----------------------------------------------------------------- host API

    @staticmethod
    def _samp(s: SlotSampling) -> dict[str, np.ndarray]:
        return {
            "temperature": s.temperature.astype(np.float32),
            "top_p": s.top_p.astype(np.float32),
            "top_k": s.top_k.astype(np.int32),
            "min_p": s.min_p.astype(np.float32),
            "banned": s.banned.astype(np.int32),
            "keys": s.keys.astype(np.uint32),
            "step": s.step.astype(np.int32),
            "logprob_temperature": s.logprob_temperature.astype(np.float32),
        }

    def prefill_bucket(self, length: int) -> int:
        """The padded prefill length for a ``length``-token prompt."""
        return next_pow2(length, self.min_bucket)

    def prefill(
        self, slots: list[int], prompts: list[list[int]], samp: SlotSampling, max_rows: int = 1
    ) -> list[tuple[int, float, np.ndarray, jax.Array]]:
        """Writes each prompt into its slot's cache and samples its first output token.

        Several prompts are padded to ``max_rows`` rows (padding rows write nowhere; one prompt
        runs alone) and to the longest prompt's bucket. ``samp`` has one row per prompt.

        Returns:
          per prompt: (token, its logprob, routes i32[len(prompt), L, K] of the prompt tokens,
          the device hidden states [S, H] for optional prompt logprobs).
        """
        n = len(prompts)
        rows = 1 if n == 1 else max(n, max_rows)  # two row buckets per length: 1 and max_rows
        s = self.prefill_bucket(max(len(q) for q in prompts))
        if s > self.slot_len:
            raise EngineError(f"prompt of {s} tokens exceeds the slot length {self.slot_len}")
        tokens = np.zeros((rows, s), np.int32)
        lengths = np.ones((rows,), np.int32)
        slot_ids = np.full((rows,), self.num_slots, np.int32)
        for i, (slot, q) in enumerate(zip(slots, prompts, strict=True)):
            tokens[i, : len(q)] = q
            lengths[i], slot_ids[i] = len(q), slot
        arrays = self._samp(samp)
        padded = {
            k: np.concatenate([v, np.repeat(v[:1], rows - n, axis=0)]) for k, v in arrays.items()
        }
        tok, lp, routes, hidden, self.cache = _prefill(
            self.params,
            self.cache,
            slot_ids,
            tokens,
            lengths,
            padded,
            config=self.config,
            runtime=self.runtime,
        )
        tok, lp, routes = jax.device_get((tok, lp, routes))
        return [
            (int(tok[i]), float(lp[i]), np.asarray(routes[i, : len(q)]), hidden[i])
            for i, q in enumerate(prompts)
        ]

    def precompile(
        self, *, prompt_len: int, total_len: int, min_batch: int = 1, max_rows: int = 1
    ) -> int:
        """Compiles ahead the buckets a workload will use, so no request waits on a compile.

        Covers prompts of ``prompt_len`` tokens (prefill rows 1 and ``max_rows``) growing to
        ``total_len`` tokens (decode batches from ``min_batch`` to ``num_slots``). Only call it
        while no request is live (the dummy steps write into free slots). Returns the number of
        compiled calls.
        """
        n = 0
        s = self.prefill_bucket(prompt_len)
        for rows in sorted({1, max_rows}):
            tokens = np.zeros((rows, s), np.int32)
            ones = np.ones((rows,), np.int32)
            slot_ids = np.full((rows,), self.num_slots, np.int32)  # every write drops
            _, _, _, _, self.cache = _prefill(
                self.params, self.cache, slot_ids, tokens, ones,
                self._samp(_dummy_sampling(rows, self.vocab_size)),
                config=self.config, runtime=self.runtime,
            )  # fmt: skip
            n += 1
        b = next_pow2(min_batch)
        while b <= self.num_slots:
            attn = next_pow2(prompt_len + 1, self.min_bucket)
            while attn <= min(self.slot_len, next_pow2(total_len, self.min_bucket)):
                zeros = np.zeros((b,), np.int32)
                self.decode(
                    zeros, np.full((b,), attn - 1, np.int32), zeros,
                    _dummy_sampling(b, self.vocab_size),
                )  # fmt: skip
                n += 1
                attn *= 2
            b *= 2
        jax.block_until_ready(self.cache)
        return n

    def prompt_logprobs(self, hidden: jax.Array, prompt: list[int]) -> np.ndarray:
        """Prompt logprobs at temperature 1 (SGLang's ``input_token_logprobs``).

        Returns f32[len(prompt)]: entry t is ``log p(prompt[t] | prompt[:t])``; entry 0 has no
        context and is NaN.
        """
        s = hidden.shape[0]
        targets = np.zeros((s,), np.int32)
        targets[: len(prompt) - 1] = prompt[1:]
        lps = np.asarray(
            jax.device_get(_prompt_logprobs(self.params, hidden, targets, config=self.config))
        )
        out = np.full((len(prompt),), np.nan, np.float32)
        out[1:] = lps[: len(prompt) - 1]
        return out

    def decode(
        self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray, samp: SlotSampling
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One decode step of the first ``len(tokens)`` slots (a power of two).

        Args:
          tokens: i32[b] the input token of each slot (its last sampled token).
          positions: i32[b] that token's position (0 for free slots).
          active: i32[b] 1 for live slots.
          samp: per-slot sampling arrays.

        Returns:
          (next tokens i32[b], their logprobs f32[b], routes i32[b, L, K] of the input tokens).
        """
        attn_len = min(self.slot_len, next_pow2(int(positions.max()) + 1, self.min_bucket))
        tok, lp, routes, self.cache = _decode(
            self.params,
            self.cache,
            tokens.astype(np.int32),
            positions.astype(np.int32),
            active.astype(np.int32),
            self._samp(samp),
            config=self.config,
            runtime=self.runtime,
            attn_len=attn_len,
        )
        tok, lp, routes = jax.device_get((tok, lp, routes))
        return np.asarray(tok), np.asarray(lp), np.asarray(routes)

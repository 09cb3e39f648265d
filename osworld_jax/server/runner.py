"""The embedded server's model runner: the trainer's own `forward`, a slot KV cache, buckets.

Shapes are bucketed so that serving never recompiles per request, from a small set fixed when
the runner is built (`serving_buckets`, which the memory plan uses too): a prefill runs its
prompts padded to a length bucket ``S`` over their slots' first ``S`` cache rows; a decode step
runs the first ``b`` slots (``b`` a batch bucket covering every live slot) over the first ``Lb``
cache rows (``Lb`` a length bucket covering every live position). The length buckets are the
slot length and the powers of two below it, at most `LENGTH_LEVELS` of them; the batch buckets
the slot count and at most `BATCH_LEVELS` - 1 halvings; a prefill after a kept prefix
attends over one of the `WINDOW_LEVELS` largest length buckets. Each (rows, S, window) and
(b, Lb) compiles once. Parameters are a jit *argument*, so a refit swaps them without recompiling.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from osworld_jax.contract.errors import EngineError
from osworld_jax.model import (
    KVCache,
    Qwen3MoeConfig,
    Qwen3VLMoeConfig,
    forward,
    init_kv_cache,
    load_hf_checkpoint,
    unembed_matrix,
)
from osworld_jax.model.serving import next_pow2
from osworld_jax.server.buckets import prefill_query_chunk, server_runtimes, serving_buckets
from osworld_jax.server.image_embeddings import ImageEmbeddings, vision_inputs
from osworld_jax.server.images import RequestImages
from osworld_jax.server.model_files import load_processor
from osworld_jax.server.sampling import (
    SlotSampling,
    dummy_sampling,
    sample,
    step_keys,
    token_logprobs,
    top_logprobs,
)

log = logging.getLogger(__name__)

#: Most top logprobs per position (``top_logprobs_num``; OpenAI's ``top_logprobs`` limit). A step
#: in which any request asks for some computes this many (one more compiled variant per bucket).
MAX_TOP_LOGPROBS = 20
#: A banned-token entry that bans nothing (`sample` drops ids past the vocabulary).
_NO_TOKEN = 1 << 30


def _logits(params: Any, hidden: jax.Array, config: Qwen3MoeConfig) -> jax.Array:
    # The same einsum as `forward`'s logits, so float32 results match the trainer exactly.
    return jnp.einsum(
        "...h,hv->...v",
        hidden,
        unembed_matrix(params, config),
        preferred_element_type=jnp.float32,
    )


def _sample(
    params: Any,
    hidden: jax.Array,
    samp: dict[str, jax.Array],
    config: Qwen3MoeConfig,
    num_top: int = 0,
):
    return sample(
        _logits(params, hidden, config),
        samp["temperature"],
        samp["top_p"],
        samp["top_k"],
        samp["min_p"],
        samp["banned"],
        step_keys(samp["keys"], samp["step"]),
        samp["logprob_temperature"],
        num_top,
    )


# Module-level jits with the (hashable, frozen) configs static: every runner of the same
# architecture in a process shares the compiled buckets.
_STATIC = ("config", "runtime", "attn_len", "num_top", "steps")


@functools.partial(jax.jit, static_argnames=_STATIC[:4], donate_argnames=("cache",))
def _prefill(
    params, cache, slots, tokens, starts, lengths, samp, vision, *, config, runtime, num_top,
    attn_len,
):  # fmt: skip
    p, s = tokens.shape
    # The XLA attention's f32 scores [P, N, chunk, attn_len] in blocks of `prefill_query_chunk`
    # queries: a 16k-token prompt's full square is 32 GiB at 32 heads.
    runtime = dataclasses.replace(
        runtime, attention_chunk=prefill_query_chunk(p, s, attn_len, config.num_attention_heads)
    )
    fresh = starts is None
    if fresh:
        # A fresh prefill writes every position in [0, S) of its rows (padding sits past
        # `length`) and attends to its own keys only (cuDNN's causal kernel on a GPU): it starts
        # from a zero cache and never reads the slots' stale contents.
        shape = (cache.k.shape[0], p, attn_len, *cache.k.shape[3:])
        sub = KVCache(jnp.zeros(shape, cache.k.dtype), jnp.zeros(shape, cache.v.dtype))
        starts = jnp.zeros((p,), jnp.int32)
    else:
        # Row r reuses its slot's rows [0, starts[r]) (a kept prefix, `prefix_cache`); the rest
        # of the attention window is zeroed, so stale rows are never read.
        read = jnp.minimum(slots, cache.k.shape[1] - 1)  # padding rows read a real slot
        keep = (jnp.arange(attn_len)[None, :] < starts[:, None])[None, :, :, None, None]
        k_rows, v_rows = cache.k[:, read, :attn_len], cache.v[:, read, :attn_len]
        sub = KVCache(jnp.where(keep, k_rows, 0), jnp.where(keep, v_rows, 0))
    positions = starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [P, S] cache rows
    segment_ids = (jnp.arange(s)[None, :] < lengths[:, None]).astype(jnp.int32)
    kw = {}
    if vision is not None:  # M-RoPE [3, P, S]; the (new) images of row r fill its image tokens
        kw = dict(image_features=(vision["embeds"], vision["deep"]))  # [P, M, H], [P, D, M, H]
    out = forward(
        params,
        config,
        runtime,
        tokens,
        positions=positions if vision is None else vision["rope"],
        segment_ids=segment_ids,
        kv_cache=sub,
        return_logits=False,
        cache_positions=positions,
        cache_fresh=fresh,
        **kw,
    )
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [P, H]
    tok, lp, top_ids, top_lps = _sample(params, last, samp, config, num_top)
    # Padding rows carry slot index num_slots: their writes drop.
    new_k = cache.k.at[:, slots, :attn_len].set(out.kv_cache.k, mode="drop")
    new_v = cache.v.at[:, slots, :attn_len].set(out.kv_cache.v, mode="drop")
    top = (top_ids, top_lps)
    return tok, lp, top, out.routed_experts, out.hidden, KVCache(new_k, new_v)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _decode(
    params, cache, tokens, positions, rope, active, samp, ban_steps, *, config, runtime,
    attn_len, num_top, steps,
):  # fmt: skip
    b = tokens.shape[0]
    sub = KVCache(cache.k[:, :b, :attn_len], cache.v[:, :b, :attn_len])  # [L, b, Lb, KV, D]

    def one(carry, i):  # decode step i: each live slot's input token -> its next token
        sub, tokens, positions, rope = carry  # [L, b, Lb, KV, D], i32[b] x 3
        # The rope position of a generated token is its cache slot plus the request's M-RoPE
        # delta (max prompt position + 1 - prompt length; 0 for text): HF's `rope_deltas` rule.
        rope_positions = rope[:, None]  # [b, 1]
        if isinstance(config, Qwen3VLMoeConfig):  # three equal rows: the M-RoPE of a text token
            rope_positions = jnp.broadcast_to(rope_positions[None], (3, b, 1))
        out = forward(
            params,
            config,
            runtime,
            tokens[:, None],
            positions=rope_positions,
            segment_ids=active[:, None],
            kv_cache=sub,
            return_logits=False,
            cache_positions=positions[:, None],
        )
        # EOS / stop ids stay banned while the slot is under its ``min_new_tokens``.
        banned = jnp.where(i < ban_steps[:, None], samp["banned"], _NO_TOKEN)  # [b, M]
        step = dict(samp, banned=banned, step=samp["step"] + i)  # the key of token step + i
        tok, lp, top_ids, top_lps = _sample(params, out.hidden[:, 0], step, config, num_top)
        # A free slot stays past the window (its writes drop); a live one moves one row on.
        carry = (out.kv_cache, tok, positions + active, rope + active)
        return carry, (tok, lp, top_ids, top_lps, out.routed_experts[:, 0])  # routes [b, L, K]

    init = (sub, tokens, positions, rope)
    (sub, *_), (tok, lp, top_ids, top_lps, routes) = jax.lax.scan(
        one, init, jnp.arange(steps, dtype=jnp.int32)
    )  # each output [steps, b, ...]
    new_k = jax.lax.dynamic_update_slice(cache.k, sub.k, (0, 0, 0, 0, 0))
    new_v = jax.lax.dynamic_update_slice(cache.v, sub.v, (0, 0, 0, 0, 0))
    return tok, lp, (top_ids, top_lps), routes, KVCache(new_k, new_v)


@functools.partial(jax.jit, static_argnames=("config", "num_top"))
def _prompt_logprobs(params, hidden, row, targets, *, config, num_top):
    hidden = hidden[row]  # [S, H] of the prompt's row
    s = hidden.shape[0]
    chunk = min(s, 256)
    hs = hidden.reshape(s // chunk, chunk, -1)
    ts = targets.reshape(s // chunk, chunk)

    def one(a):
        logits = _logits(params, a[0], config)
        return token_logprobs(logits, a[1]), top_logprobs(logits, num_top)

    lps, (top_ids, top_lps) = jax.lax.map(one, (hs, ts))
    return lps.reshape(s), top_ids.reshape(s, num_top), top_lps.reshape(s, num_top)


@dataclass(frozen=True)
class PrefillResult:
    """One prompt's prefill.

    Attributes:
      token: the first output token; logprob: its logprob.
      routes: i32[len(prompt), L, K] routes of the prompt tokens.
      hidden: device [P, S, H] final hidden states of the prefill's rows (for optional prompt
        logprobs; sliced inside `_prompt_logprobs`, so no per-shape slicing program compiles).
      rope_delta: M-RoPE delta of the prompt (max position + 1 - length; 0 for text): the
        rope position of cache slot j >= len(prompt) is ``j + rope_delta``.
      top: (ids i32[k], logprobs f32[k]) of the first token's distribution, k = ``num_top``.
      row: this prompt's row of ``hidden``.
    """

    token: int
    logprob: float
    routes: np.ndarray
    hidden: Any
    rope_delta: int
    top: tuple[np.ndarray, np.ndarray]
    row: int = 0


class ModelRunner:
    """Owns the parameters and the KV cache; runs bucketed prefill and decode steps.

    Args:
      model_path: HF checkpoint directory (config.json + safetensors).
      num_slots: concurrent requests (``--max-running-requests``); rounded up to a power of two.
      slot_len: tokens per slot (the context length); rounded up to a power of two.
      dtype: "float32" or "bfloat16" (parameters, activations and KV cache).
      expert_backend: the model's expert backend ("auto", "dense", "ragged", ...).
      min_bucket: smallest prefill / attention-length bucket.
      min_decode_batch: smallest decode batch bucket.
      max_prefill_batch: most rows of a batched prefill (`ServingBuckets.prefill_rows`).
      mm_attention: the ViT's attention, "cudnn" (cuDNN's packed flash attention per image on a
        GPU in 16-bit, the trainer's kernel; XLA elsewhere) or "xla".
      scan_layers: run the decoder layers and ViT blocks under ``lax.scan`` (compiles a deep
        model in a fraction of the time; the values are the unrolled loop's); None: on an
        accelerator only (the CPU's tiny models compile fast either way).
      embedding_cache_bytes: device bytes of image embeddings kept by content hash
        (`ImageEmbeddings`; a Qwen3-VL model).
      decode_steps: decode steps per device call (`decode`; SGLang's
        ``--num-continuous-decode-steps``): one dispatch and one copy back per n tokens.
      extra_length_buckets: length buckets beside the powers of two (`serving_buckets`).
      decode_expert_backend: the decode steps' expert backend (None: ``expert_backend``);
        "dense" reads every expert's weights once per step, which a batch of slots routing to
        most experts reads anyway, without a grouped kernel's per-expert tiles.
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
        min_decode_batch: int = 1,
        max_prefill_batch: int = 8,
        mm_attention: str = "cudnn",
        scan_layers: bool | None = None,
        embedding_cache_bytes: int = 512 << 20,
        decode_steps: int = 1,
        extra_length_buckets: Sequence[int] = (),
        decode_expert_backend: str | None = None,
    ) -> None:
        self.runtime, self.decode_runtime = server_runtimes(
            dtype, expert_backend, mm_attention, scan_layers, decode_expert_backend
        )
        policy = load_hf_checkpoint(model_path, runtime=self.runtime)
        self.config: Qwen3MoeConfig = policy.config
        self.processor = load_processor(Path(model_path), self.config)  # None: a text model
        self.embeddings: ImageEmbeddings | None = None
        if isinstance(self.config, Qwen3VLMoeConfig):
            self.embeddings = ImageEmbeddings(
                self.config, self.runtime, embedding_cache_bytes, self.processor
            )
        self.params = policy.params()
        self.num_slots = next_pow2(num_slots)
        self.decode_steps = max(1, decode_steps)
        self.slot_len = next_pow2(slot_len, min_bucket)
        self.min_bucket = min_bucket
        self.buckets = serving_buckets(
            slot_len=self.slot_len,
            num_slots=self.num_slots,
            min_bucket=min_bucket,
            min_decode_batch=min_decode_batch,
            max_prefill_batch=max_prefill_batch,
            extra_lengths=extra_length_buckets,
        )
        self.vocab_size = self.config.vocab_size
        # Committed to the parameters' device, like every later (donated, returned) cache:
        # an uncommitted first cache would compile each bucket twice.
        device = jax.tree.leaves(self.params)[0].sharding
        self.cache: KVCache = jax.device_put(
            init_kv_cache(self.config, self.num_slots, self.slot_len, jnp.dtype(dtype)), device
        )

    # ----------------------------------------------------------------- weights

    @property
    def params(self) -> Any:
        """The served parameters (a jit argument: setting them recompiles nothing)."""
        return self._params

    @params.setter
    def params(self, value: Any) -> None:
        self._params = value
        if self.embeddings is not None:  # they are the old weights' tower outputs
            self.embeddings.clear()

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
        """The padded prefill length for a ``length``-token prompt (`ServingBuckets.length`)."""
        return self.buckets.length(length)

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        samp: SlotSampling,
        max_rows: int = 1,
        images: list[RequestImages | None] | None = None,
        num_top: int = 0,
        starts: list[int] | None = None,
    ) -> list[PrefillResult]:
        """Writes each prompt into its slot's cache and samples its first output token.

        Several prompts are padded to ``max_rows`` rows (padding rows write nowhere; one prompt
        runs alone) and to the longest prompt's bucket. ``samp`` has one row per prompt. With
        ``images`` (a Qwen3-VL model), prompt r's images fill its ``<|image_pad|>`` tokens and
        the prompt runs at its M-RoPE positions (`mrope_positions`), its images through the
        tower one by one or from the cache (`image_embeddings`). With ``starts``, prompt r's
        slot already holds the KV of its first ``starts[r]`` tokens (a kept prefix, whole
        images only): only the rest is computed, attending to the kept rows.

        Returns:
          per prompt a `PrefillResult` (``num_top`` top logprobs of the first token).
        """
        n = len(prompts)
        starts = starts or [0] * n
        rows = 1 if n == 1 else max(n, max_rows)  # two row buckets per length: 1 and max_rows
        s = self.prefill_bucket(max(len(q) - a for q, a in zip(prompts, starts, strict=True)))
        attn = self.attention_bucket(prompts, starts)
        if attn > self.slot_len:
            raise EngineError(f"prompt of {attn} tokens exceeds the slot length {self.slot_len}")
        tokens = np.zeros((rows, s), np.int32)
        lengths = np.ones((rows,), np.int32)
        first = np.zeros((rows,), np.int32)
        slot_ids = np.full((rows,), self.num_slots, np.int32)
        for i, (slot, q, a) in enumerate(zip(slots, prompts, starts, strict=True)):
            tokens[i, : len(q) - a] = q[a:]
            lengths[i], slot_ids[i], first[i] = len(q) - a, slot, a
        arrays = self._samp(samp)
        padded = {
            k: np.concatenate([v, np.repeat(v[:1], rows - n, axis=0)]) for k, v in arrays.items()
        }
        vision, deltas = None, [0] * n
        if images is not None and any(im is not None for im in images):
            if self.embeddings is None:
                raise EngineError("images need a qwen3_vl_moe checkpoint")
            vision, deltas = vision_inputs(
                self.config, self.embeddings, self.params, prompts, starts, s, rows, images
            )
        tok, lp, top, routes, hidden, self.cache = _prefill(
            self.params,
            self.cache,
            slot_ids,
            tokens,
            first if any(starts) else None,
            lengths,
            padded,
            vision,
            config=self.config,
            runtime=self.runtime,
            num_top=num_top,
            attn_len=attn,
        )
        tok, lp, top, routes = jax.device_get((tok, lp, top, routes))
        return [
            PrefillResult(
                token=int(tok[i]),
                logprob=float(lp[i]),
                routes=np.asarray(routes[i, : len(q) - starts[i]]),
                hidden=hidden,
                row=i,
                rope_delta=deltas[i],
                top=(np.asarray(top[0][i]), np.asarray(top[1][i])),
            )
            for i, q in enumerate(prompts)
        ]

    def attention_bucket(self, prompts: Sequence[Sequence[int]], starts: Sequence[int]) -> int:
        """The attention window (cache rows) of a prefill.

        Its suffix bucket when nothing is reused, else the window covering every row's whole
        sequence (`ServingBuckets.window`: one of the two largest length buckets).
        """
        s = self.prefill_bucket(max(len(q) - a for q, a in zip(prompts, starts, strict=True)))
        if not any(starts):
            return s
        return max(s, self.buckets.window(max(len(q) for q in prompts)))

    def precompile(
        self, *, prompt_len: int | None = None, total_len: int | None = None, prefill: bool = True
    ) -> int:
        """Compiles ahead the buckets a workload will use, so no request waits on a compile.

        Covers text prompts of ``prompt_len`` tokens (prefill rows 1 and the bucket's batched
        rows) growing to ``total_len`` tokens (every decode batch bucket); without them, every
        text prefill and decode bucket of `buckets` (only the decode ones without ``prefill``).
        Only call it while no request is live (the dummy steps write nowhere: every prefill row
        is padding, every decode slot inactive). Returns the number of compiled calls.
        """
        lengths = self.buckets.lengths if prefill else ()
        if prompt_len is not None and prefill:
            lengths = (self.prefill_bucket(prompt_len),)
        n = 0
        for s in lengths:
            for rows in sorted({1, self.buckets.prefill_rows(s)}):
                tokens = np.zeros((rows, s), np.int32)
                ones = np.ones((rows,), np.int32)
                slot_ids = np.full((rows,), self.num_slots, np.int32)  # every write drops
                *_, self.cache = _prefill(
                    self.params, self.cache, slot_ids, tokens, None, ones,
                    self._samp(dummy_sampling(rows, self.vocab_size)), None,
                    config=self.config, runtime=self.runtime, num_top=0, attn_len=s,
                )  # fmt: skip
                n += 1
        for n_steps in sorted({1, self.decode_steps}):  # one step while prefills wait
            # A call's window covers its last step's row (`decode`).
            low = self.prefill_bucket(prompt_len + n_steps) if prompt_len is not None else 1
            high = self.slot_len
            if total_len is not None:
                high = min(self.slot_len, self.prefill_bucket(total_len - 1 + n_steps))
            windows = [w for w in self.buckets.lengths if low <= w <= high]
            for b in self.buckets.batches:
                for attn in windows:
                    zeros = np.zeros((b,), np.int32)
                    self.decode(
                        zeros, zeros, zeros, dummy_sampling(b, self.vocab_size), attn_len=attn,
                        steps=n_steps,
                    )  # fmt: skip
                    n += 1
        jax.block_until_ready(self.cache)
        return n

    def prompt_logprobs(
        self,
        hidden: jax.Array,
        prompt: list[int],
        num_top: int = 0,
        start: int = 0,
        row: int = 0,
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """Prompt logprobs at temperature 1 (SGLang's ``input_token_logprobs``).

        ``hidden[row]`` [S, H] (`PrefillResult`'s ``hidden`` [P, S, H]) holds positions
        ``[start, start + S)`` (a prefill after a kept prefix of ``start`` tokens).

        Returns:
          (f32[len(prompt)]: entry t is ``log p(prompt[t] | prompt[:t])``; entry 0, and entries
          t <= start, are NaN (no context / not computed); with ``num_top``, (ids i32[len, k],
          logprobs f32[len, k]) of the k most likely tokens at each computed position (other
          rows 0), else None).
        """
        s = hidden.shape[1]
        n = len(prompt) - 1 - start  # predictions of tokens start + 1 .. len - 1
        targets = np.zeros((s,), np.int32)
        targets[:n] = prompt[start + 1 :]
        lps, top_ids, top_lps = jax.device_get(
            _prompt_logprobs(
                self.params, hidden, np.int32(row), targets, config=self.config, num_top=num_top
            )
        )
        out = np.full((len(prompt),), np.nan, np.float32)
        out[start + 1 :] = np.asarray(lps)[:n]
        if not num_top:
            return out, None
        ids = np.zeros((len(prompt), num_top), np.int32)
        values = np.zeros((len(prompt), num_top), np.float32)
        ids[start + 1 :], values[start + 1 :] = top_ids[:n], top_lps[:n]
        return out, (ids, values)

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        active: np.ndarray,
        samp: SlotSampling,
        rope: np.ndarray | None = None,
        num_top: int = 0,
        attn_len: int | None = None,
        ban_steps: np.ndarray | None = None,
        steps: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """``steps`` decode steps of the first ``len(tokens)`` slots (a power of two).

        Step ``i`` feeds each live slot the token step ``i - 1`` sampled (``tokens`` at step 0)
        and samples with the key of ``samp.step + i``: one call of n steps gives the tokens of
        n calls of one step. A slot finishing within the call runs on to its end (the caller
        drops what follows; its rows past the sequence are written, and never read).

        Args:
          tokens: i32[b] the input token of each slot (its last sampled token).
          positions: i32[b] that token's cache slot (0 for free slots).
          active: i32[b] 1 for live slots.
          samp: per-slot sampling arrays (``banned`` holds while a step is below ``ban_steps``).
          rope: i32[b] its rope position (``positions + rope_delta``; default ``positions``).
          num_top: how many top logprobs of each next-token distribution to return.
          attn_len: the attention window (default: a bucket covering the live positions of
            every step).
          ban_steps: i32[b] steps of this call under ``samp.banned`` (``min_new_tokens``);
            default: every step.
          steps: 1 or `decode_steps` (the default): one compiled program per count and bucket.

        Returns:
          (next tokens i32[n, b], their logprobs f32[n, b], routes i32[n, b, L, K] of the input
          tokens, (top ids i32[n, b, k], top logprobs f32[n, b, k])), ``n`` = ``steps``.
        """
        n = self.decode_steps if steps is None else steps
        if attn_len is None:
            live = positions[active > 0]
            top_row = int(live.max()) + n if live.size else 1
            attn_len = min(self.slot_len, self.prefill_bucket(top_row))
        rope = positions if rope is None else rope
        if ban_steps is None:
            ban_steps = np.full(len(tokens), n, np.int32)
        # A free slot's row gets a cache position past the window: its write is dropped, so the
        # prefix a free slot keeps (`prefix_cache`) is never overwritten by a decode step.
        positions = np.where(active > 0, positions, attn_len)
        tok, lp, top, routes, self.cache = _decode(
            self.params,
            self.cache,
            tokens.astype(np.int32),
            positions.astype(np.int32),
            rope.astype(np.int32),
            active.astype(np.int32),
            self._samp(samp),
            ban_steps.astype(np.int32),
            config=self.config,
            runtime=self.decode_runtime,
            attn_len=attn_len,
            num_top=num_top,
            steps=n,
        )
        tok, lp, top, routes = jax.device_get((tok, lp, top, routes))
        return np.asarray(tok), np.asarray(lp), np.asarray(routes), top

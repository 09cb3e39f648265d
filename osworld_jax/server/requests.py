"""The embedded engine's data: its settings (`EngineConfig`) and one request (`GenRequest`).

`build_request` turns validated wire values into a `GenRequest` (`Engine.make_request`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from osworld_jax.contract.sampling import GREEDY_EPS, logprob_temperature
from osworld_jax.server.images import RequestImages
from osworld_jax.server.runner import MAX_TOP_LOGPROBS

#: ``top_k`` of a request that keeps every token (SGLang's -1).
TOP_K_ALL = 1 << 30


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of the embedded engine (the ``serve`` flags).

    Attributes:
      model_path: HF checkpoint directory (config.json, safetensors, and tokenizer.json unless
        ``skip_tokenizer_init``).
      max_running_requests: KV-cache slots, i.e. requests decoded together (rounded up to a
        power of two); more requests wait in a queue.
      context_length: most tokens (prompt + output) per request; default
        ``min(max_position_embeddings, 4096)``. Rounded up to a power of two for the cache.
      max_total_tokens: KV-cache token budget; when set, the slot count is capped at
        ``max_total_tokens // slot_len``.
      dtype: "float32" or "bfloat16" (parameters, activations, KV cache).
      expert_backend: `osworld_jax.model` expert backend ("auto", "dense", "ragged", ...).
      weight_version: the initial weight version reported in every reply.
      enable_return_routed_experts: allow ``return_routed_experts`` (as SGLang's flag).
      seed: seeds the server's randomness for requests without ``sampling_seed``.
      min_bucket: smallest prefill / attention-length bucket (fewer compiles when larger).
      min_decode_batch: smallest decode batch bucket (a decode step runs the first ``b``
        slots, ``b`` a power of two >= this and covering every live slot).
      max_prefill_tokens: new prompt tokens admitted to prefill before the next decode step
        (SGLang's ``--max-prefill-tokens``; the first waiting request is admitted whatever its
        length): a burst of long prompts does not stall the running requests' decoding.
      max_prefill_batch: most admitted requests of one length bucket prefilled in one call
        (padded to this many rows; a lone request runs alone; long buckets run one by one).
      return_original_logprob: report output logprobs at temperature 1 (the model's own
        distribution) instead of at the request's temperature, as SGLang does under
        ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (`osworld_jax.contract.sampling.logprob_temperature`).
      enable_prefix_cache: a free slot keeps the KV of the sequence it held and a request
        extending it reuses it (`osworld_jax.server.prefix_cache`; False is SGLang's
        ``--disable-radix-cache``).
      skip_tokenizer_init: serve token ids only, without loading a tokenizer (SGLang's
        ``--skip-tokenizer-init``): ``text`` prompts, ``stop`` strings and ``min_new_tokens``
        are refused, replies carry no ``text`` and logprob entries no token text.
      stall_timeout_s: ``/health`` answers 503 when the engine thread has not finished an
        iteration for this long while work is pending (a stuck step or weight load).
      mm_attention_backend: the vision tower's attention (SGLang's ``--mm-attention-backend``):
        "cudnn" (cuDNN's packed flash attention within each image on a GPU in bfloat16, the
        trainer's kernel; XLA on other platforms and in float32) or "xla".
      scan_layers: run the layers under ``lax.scan`` (a deep model's prefill and decode
        buckets compile in a fraction of the time); None: on an accelerator, not on a CPU.
      vlm_cache_size_mb: MiB of processed images (uint8 patch levels) kept by content hash
        (`osworld_jax.server.images.ProcessedImageCache`); 0: none.
      mm_embedding_cache_mb: MiB of device memory for the vision tower's outputs kept by
        content hash (`osworld_jax.server.image_embeddings.ImageEmbeddings`); 0: none kept.
      switch_interval_ms: the process's GIL switch interval while the engine runs
        (``sys.setswitchinterval``; only ever lowered; None: Python's, 5 ms). The engine thread
        waits for the GIL after every device step; a thread busy in Python beside it (HTTP
        handlers, a trainer's host work, rollouts) holds it up to this long each time:
        benchmarks/engine_gil.py, 319 -> 41 tok/s at 5 ms, 254 at 0.2 ms.
      num_continuous_decode_steps: decode steps per device call (SGLang's flag of the same
        name): one dispatch, one copy back and one scheduling pass per n tokens of every
        running request; while prompts wait for admission a call runs one step. A request
        arriving mid-call waits for its end, and one finishing inside a call wastes the rest.
      warmup_decode_buckets: compile every decode (batch, window, steps) bucket when the
        engine starts, as SGLang captures its decode CUDA graphs (None: on an accelerator).
      extra_length_buckets: prefill lengths and attention windows beside the powers of two
        (`osworld_jax.server.buckets.serving_buckets`): 3072 pads a one-screenshot prompt of
        ~2,100 tokens to 3,072 instead of 4,096 (each is one more program per batch shape).
      decode_expert_backend: the decode steps' expert backend (None: ``expert_backend``):
        "dense" runs every expert on the slots' tokens, reading each expert's weights once a
        step, as a batch whose tokens route to most experts does anyway.
      memory_budget_bytes: what the engine's weights and KV cache may hold of its device
        (the colocated server's share of the process it shares with the trainer); None: the
        allocator's limit (a server of its own process, ``XLA_PYTHON_CLIENT_MEM_FRACTION``).
    """

    model_path: str
    max_running_requests: int = 16
    context_length: int | None = None
    max_total_tokens: int | None = None
    dtype: str = "float32"
    expert_backend: str = "auto"
    weight_version: str = "default"
    enable_return_routed_experts: bool = False
    seed: int = 0
    min_bucket: int = 16
    min_decode_batch: int = 1
    max_prefill_batch: int = 8
    max_prefill_tokens: int = 16384
    return_original_logprob: bool = False
    enable_prefix_cache: bool = True
    skip_tokenizer_init: bool = False
    stall_timeout_s: float = 300.0
    mm_attention_backend: str = "cudnn"
    scan_layers: bool | None = None
    vlm_cache_size_mb: int = 2048
    mm_embedding_cache_mb: int = 512
    switch_interval_ms: float | None = 0.2
    num_continuous_decode_steps: int = 1
    warmup_decode_buckets: bool | None = None
    extra_length_buckets: tuple[int, ...] = ()
    decode_expert_backend: str | None = None
    memory_budget_bytes: float | None = None


@dataclass(kw_only=True, eq=False)
class GenRequest:
    """One validated generation request and its progress (mutated only on the engine thread).

    Attributes:
      rid: request id.
      input_ids: prompt token ids.
      temperature, top_p, top_k, min_p: normalised sampling (greedy -> T=1, top_k=1).
      logprob_temperature: temperature of the reported output logprobs.
      max_new_tokens, min_new_tokens: output length bounds.
      stop: stop strings; stop_token_ids: stop ids; ignore_eos: do not stop at EOS.
      skip_special_tokens, no_stop_trim: text decoding options.
      key: u32[2] the request's PRNG key.
      return_logprob, logprob_start_len: logprob options (start -1 = output only).
      top_logprobs_num: how many top logprobs each position reports (with return_logprob).
      return_text_in_logprobs: put each token's text in its logprob entries.
      return_routed_experts, routed_experts_start_len: route options.
      images: the request's processed images (`RequestImages`), None for text.
      rope_delta: M-RoPE delta of the prompt (set at prefill): cache slot j >= len(prompt)
        is at rope position ``j + rope_delta`` (HF's ``rope_deltas``).
      notify: ``notify(request, done)`` called on the engine thread after progress.
      output_ids, output_logprobs, routes, input_logprobs, finish: progress.
      output_top, input_top: top logprobs (ids, logprobs) of each output position / of the
        prompt positions ([len, k] arrays), with ``top_logprobs_num``.
      cached_tokens: prompt tokens whose KV came from the prefix cache.
      prefix_key: i64 prefix-cache keys of the prompt (images keyed by their bytes).
      match: tokens of its current prefill reused from its slot's kept prefix.
      image_hold: its body's `osworld_jax.server.images.ImageHold` (decoded pixels reserved
        in the server's budget), released by the HTTP side at its first notify.
    """

    rid: str
    input_ids: list[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    logprob_temperature: float
    max_new_tokens: int
    min_new_tokens: int
    stop: list[str]
    stop_token_ids: set[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    key: np.ndarray
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    return_routed_experts: bool
    routed_experts_start_len: int
    images: RequestImages | None = None
    rope_delta: int = 0
    notify: Callable[[GenRequest, bool], None] = lambda r, d: None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    num_route_rows: int = 0
    input_logprobs: np.ndarray | None = None
    output_top: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    input_top: tuple[np.ndarray, np.ndarray] | None = None
    cached_tokens: int = 0
    prefix_key: np.ndarray | None = None
    match: int = 0
    token_texts: dict[str, list[str]] = field(default_factory=dict)
    finish: dict[str, Any] | None = None
    slot: int | None = None
    created: float = field(default_factory=time.monotonic)
    stop_window: int = 0
    image_hold: Any = None


def build_request(
    *,
    rid: str | None,
    input_ids: list[int],
    sampling: dict[str, Any],
    rng: np.random.Generator,
    context_length: int,
    return_original_logprob: bool = False,
    tokenizer: Any = None,
    **opts: Any,
) -> GenRequest:
    """A `GenRequest` of already validated wire values (`osworld_jax.server.protocol`).

    SGLang's conventions: a temperature below ``GREEDY_EPS`` is greedy (temperature 1, top-k
    1), ``top_k = -1`` (or any beyond ``TOP_K_ALL``) is every token, a ``sampling_seed`` (int64,
    negatives wrap) fixes the request's key (else ``rng`` draws one), ``max_new_tokens`` is
    clamped to what fits
    ``context_length``. ``tokenizer`` (None: no stop strings are matched) sizes the window of
    output tokens decoded to look for stop strings.
    """
    temperature = float(sampling.get("temperature", 1.0))
    top_k = int(sampling.get("top_k", -1))
    lp_temperature = logprob_temperature(
        temperature, return_original_logprob=return_original_logprob
    )
    if temperature < GREEDY_EPS:  # SGLang: greedy == temperature 1 with top_k 1
        temperature, top_k = 1.0, 1
    top_k = TOP_K_ALL if top_k == -1 else min(top_k, TOP_K_ALL)  # int32 on the device
    seed = sampling.get("sampling_seed")
    if seed is None:
        key = rng.integers(0, 2**32, size=2, dtype=np.uint32)
    else:
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF  # SGLang seeds are int64; negatives wrap
        key = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    stop = sampling.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    max_new = int(sampling.get("max_new_tokens", 128))
    req = GenRequest(
        rid=rid or uuid.uuid4().hex,
        input_ids=[int(t) for t in input_ids],
        temperature=temperature,
        top_p=float(sampling.get("top_p", 1.0)),
        top_k=top_k,
        min_p=float(sampling.get("min_p", 0.0)),
        logprob_temperature=lp_temperature,
        max_new_tokens=min(max_new, context_length - len(input_ids)),
        min_new_tokens=int(sampling.get("min_new_tokens", 0)),
        stop=stop,
        stop_token_ids={int(t) for t in sampling.get("stop_token_ids") or []},
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        skip_special_tokens=bool(sampling.get("skip_special_tokens", True)),
        no_stop_trim=bool(sampling.get("no_stop_trim", False)),
        key=key,
        return_logprob=bool(opts.get("return_logprob", False)),
        logprob_start_len=int(opts.get("logprob_start_len", -1)),
        top_logprobs_num=int(opts.get("top_logprobs_num", 0)),
        return_text_in_logprobs=bool(opts.get("return_text_in_logprobs", False)),
        return_routed_experts=bool(opts.get("return_routed_experts", False)),
        routed_experts_start_len=int(opts.get("routed_experts_start_len", 0)),
        images=opts.get("images"),
    )
    if stop and tokenizer is not None:
        req.stop_window = 2 + max(len(tokenizer.encode(s).ids) for s in stop)
    return req


def num_top(reqs: Sequence[GenRequest | None]) -> int:
    """Top logprobs a step computes: all of `MAX_TOP_LOGPROBS` if any request asks, else 0."""
    wants = any(r is not None and r.return_logprob and r.top_logprobs_num for r in reqs)
    return MAX_TOP_LOGPROBS if wants else 0

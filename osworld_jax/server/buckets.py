"""The fixed shapes and runtimes of the embedded server's programs (engine and memory plan alike).

`serving_buckets` and `server_runtimes` are what the engine and the memory plan share.

A run compiles each prefill length, attention window and decode batch once: the set is fixed at
engine start from the cache layout (`serving_buckets`), and images pad to `patch_bucket` sizes.
A prefill's attention runs in query blocks of `prefill_query_chunk` (static per shape).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax

from osworld_jax.contract.errors import EngineError
from osworld_jax.model.config import ModelRuntimeConfig
from osworld_jax.model.serving import next_pow2

#: Batched prefills hold at most this many (padded) tokens.
PREFILL_BATCH_TOKENS = 8192
#: Most length buckets (prefill lengths, attention windows): the slot length and the powers of
#: two below it. A prompt of a fraction of the slot length pads to ``slot_len / 2**(levels-1)``.
LENGTH_LEVELS = 4
#: Most decode batch buckets: the slot count and the powers of two below it. Four: a lone
#: request on a 64-slot server decodes at batch 8, not 32 (bench-vl on an H100, C = 1: 50 tok/s
#: at batch 32, 111 at batch 1; the LM head and the sampler's vocabulary sort scale with rows).
BATCH_LEVELS = 4
#: Most attention windows of a prefill after a kept prefix (the largest length buckets): its
#: programs are (suffix bucket, window) pairs, so the windows are few.
WINDOW_LEVELS = 2


def _ladder(top: int, floor: int, levels: int) -> tuple[int, ...]:
    """``top, top / 2, ...`` ascending: at most ``levels`` values, none below ``floor``."""
    return tuple(sorted({max(floor, top >> i, 1) for i in range(levels)} | {top}))


def _smallest(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    return next_pow2(n)  # past the largest: the caller refuses it (longer than a slot)


@dataclass(frozen=True)
class ServingBuckets:
    """The fixed shapes the engine's programs take (`serving_buckets`).

    Attributes:
      lengths: prefill lengths and attention windows, ascending (the last is the slot length).
      batches: decode batch sizes, ascending (the last is the slot count).
      max_prefill_batch: most rows of a batched prefill.
    """

    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    max_prefill_batch: int

    def length(self, n: int) -> int:
        """The length bucket of ``n`` tokens (a power of two past the slot length)."""
        return _smallest(self.lengths, max(n, 1))

    def window(self, n: int) -> int:
        """The attention window of a prefill after a kept prefix, ``n`` tokens in all."""
        return _smallest(self.lengths[-WINDOW_LEVELS:], max(n, 1))

    def batch(self, n: int) -> int:
        """The decode batch bucket covering slots ``[0, n)``."""
        return min(_smallest(self.batches, max(n, 1)), self.batches[-1])

    def prefill_rows(self, length: int) -> int:
        """Rows of a batched prefill of length bucket ``length`` (a lone prompt runs alone)."""
        return max(1, min(self.max_prefill_batch, PREFILL_BATCH_TOKENS // length))


def serving_buckets(
    *,
    slot_len: int,
    num_slots: int,
    min_bucket: int = 16,
    min_decode_batch: int = 1,
    max_prefill_batch: int = 8,
    extra_lengths: Sequence[int] = (),
) -> ServingBuckets:
    """The engine's bucket set, fixed by its cache layout (the engine and the memory plan).

    ``slot_len`` and ``num_slots`` are the cache's (powers of two); ``min_bucket`` the smallest
    length bucket, ``min_decode_batch`` the smallest decode batch; ``extra_lengths`` further
    length buckets (``--extra-length-buckets``: a 2,080-token screenshot prompt pads to 3,072
    instead of 4,096), each in ``[next_pow2(min_bucket), slot_len]``.

    >>> serving_buckets(slot_len=4096, num_slots=8).lengths
    (512, 1024, 2048, 4096)
    >>> serving_buckets(slot_len=4096, num_slots=8).batches
    (1, 2, 4, 8)
    >>> serving_buckets(slot_len=4096, num_slots=8, extra_lengths=(3072,)).lengths
    (512, 1024, 2048, 3072, 4096)
    """
    lengths = _ladder(slot_len, next_pow2(min_bucket), LENGTH_LEVELS)
    for n in extra_lengths:
        if not next_pow2(min_bucket) <= n <= slot_len:
            raise EngineError(
                f"length bucket {n} is not between the smallest bucket {next_pow2(min_bucket)} "
                f"and the slot length {slot_len} (--extra-length-buckets)"
            )
    lengths = tuple(sorted(set(lengths) | set(extra_lengths)))
    batches = _ladder(num_slots, min(next_pow2(min_decode_batch), num_slots), BATCH_LEVELS)
    return ServingBuckets(lengths, batches, max(1, max_prefill_batch))


def patch_bucket(n: int, unit: int) -> int:
    """Smallest ``b >= n`` of the series ``unit * {1, 2, 3, 4, 6, 8, 12, ...}``.

    At most a third is padding and few shapes compile; ``unit`` is merge^2, so merged rows stay
    whole.

    >>> [patch_bucket(n, 4) for n in (1, 5, 9, 13, 576)]
    [4, 8, 12, 16, 768]
    """
    b = unit
    while b < n:
        if b * 3 // 2 >= n and (b * 3 // 2) % unit == 0:
            return b * 3 // 2
        b *= 2
    return b


#: Bytes of one query block's float32 attention scores in a prefill (`prefill_query_chunk`).
PREFILL_SCORE_BYTES = 1 << 30


def prefill_query_chunk(rows: int, length: int, attn_len: int, heads: int) -> int:
    """Queries per attention block of a ``rows x length`` prefill over ``attn_len`` cache rows.

    The largest power of two whose float32 scores ``[rows, heads, chunk, attn_len]`` stay
    within `PREFILL_SCORE_BYTES`, at least 16; 0 (one block) when the whole prompt fits.

    >>> prefill_query_chunk(1, 16384, 16384, 32)  # 2 GiB a block at 1024: 512 queries
    512
    >>> prefill_query_chunk(8, 512, 512, 32)  # 32 MiB: one block
    0
    """
    per_query = rows * heads * attn_len * 4
    if per_query * length <= PREFILL_SCORE_BYTES:
        return 0
    chunk = 1 << max(4, (PREFILL_SCORE_BYTES // per_query).bit_length() - 1)
    return chunk if chunk < length else 0


def server_runtimes(
    dtype: str,
    expert_backend: str,
    mm_attention: str,
    scan_layers: bool | None,
    decode_expert_backend: str | None,
) -> tuple[ModelRuntimeConfig, ModelRuntimeConfig]:
    """The prefill programs' runtime and the decode programs' (``decode_expert_backend``).

    ``attention="cudnn"`` is a fresh prefill's (`layers.own_causal_attention`; XLA off a GPU).
    """
    runtime = ModelRuntimeConfig(
        expert_backend=expert_backend,
        dtype=dtype,  # type: ignore[arg-type]  # validated
        vision_attention=mm_attention,  # type: ignore[arg-type]  # validated
        scan_layers=jax.default_backend() != "cpu" if scan_layers is None else scan_layers,
        attention="cudnn",
    )
    backend = decode_expert_backend or expert_backend
    return runtime, dataclasses.replace(runtime, expert_backend=backend)

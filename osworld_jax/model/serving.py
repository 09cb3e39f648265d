"""A serving process's device memory, known before it starts: the weights and slot KV cache.

The embedded server sizes its KV cache from its flags alone (`cache_layout`: the numbers it
allocates, `init_kv_cache`'s shape), so both the server (`osworld_jax.server.memory`) and a run
that starts it (a GPU shared with the trainer: ``ServerConfig.device_memory_fraction``) can
check that it fits before anything is loaded or compiled. No jax.
"""

from __future__ import annotations

import dataclasses

from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.params import param_counts

GiB = float(1 << 30)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
#: The server's ``--min-bucket``: smallest prefill / attention-length bucket.
DEFAULT_MIN_BUCKET = 16


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)``."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The engine's KV cache: ``slots`` rows of ``slot_len`` tokens (both powers of two).

    Attributes:
      context_length: the longest prompt + generation a request may have.
      slots: concurrent requests (rows of the cache).
      slot_len: tokens per row (``context_length`` rounded up to a power of two).
    """

    context_length: int
    slots: int
    slot_len: int


def cache_layout(
    config: Qwen3MoeConfig,
    *,
    max_running_requests: int,
    context_length: int | None,
    max_total_tokens: int | None,
    min_bucket: int = DEFAULT_MIN_BUCKET,
) -> CacheLayout:
    """The KV cache the engine allocates for these flags (``--context-length`` default:
    ``min(max_position_embeddings, 4096)``; ``--max-total-tokens`` caps the rows)."""  # noqa: D205, D209
    context = context_length or min(config.max_position_embeddings, 4096)
    slot_len = next_pow2(context, min_bucket)
    slots = max_running_requests
    if max_total_tokens is not None:
        slots = max(1, min(slots, max_total_tokens // slot_len))
    return CacheLayout(context, next_pow2(slots), slot_len)


@dataclasses.dataclass(frozen=True)
class ServerMemory:
    """Bytes on the server's device, before activations.

    Attributes:
      weights: one copy of the parameters in the serving dtype.
      kv_cache: keys and values of every layer, slot and position.
    """

    weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        """Two copies of the weights (a refit loads the new ones beside the old) + the cache."""
        return 2 * self.weights + self.kv_cache

    def describe(self) -> str:
        """``"31.2 GiB (weights 2 x 11.0 + KV cache 9.2)"``."""
        return (
            f"{self.total / GiB:.1f} GiB (weights 2 x {self.weights / GiB:.1f} + KV cache "
            f"{self.kv_cache / GiB:.1f})"
        )


def fit_problem(memory: ServerMemory, capacity: float | None) -> str | None:
    """Why ``memory`` does not fit ``capacity`` bytes (None: it fits, or nothing to check)."""
    if capacity is None or memory.total <= capacity:
        return None
    return f"needs ~{memory.describe()} of the {capacity / GiB:.1f} GiB it may use"


def server_memory(config: Qwen3MoeConfig, layout: CacheLayout, dtype: str) -> ServerMemory:
    """The weights and KV cache of a server of ``config`` in ``dtype`` with ``layout``."""
    size = _DTYPE_BYTES[dtype]
    params = param_counts(config)["total"]
    c = config
    kv = 2 * c.num_hidden_layers * layout.slots * layout.slot_len
    kv *= c.num_key_value_heads * c.head_dim * size
    return ServerMemory(weights=params * size, kv_cache=kv)

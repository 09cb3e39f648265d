"""The server refuses, before loading any weight, a KV cache its device share cannot hold."""

from __future__ import annotations

from osworld_jax.contract.errors import EngineError
from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.serving import CacheLayout, cache_layout, fit_problem, server_memory
from osworld_jax.server.requests import EngineConfig


def engine_layout(model: Qwen3MoeConfig, config: EngineConfig) -> CacheLayout:
    """The KV cache the engine allocates for its flags."""
    return cache_layout(
        model,
        max_running_requests=config.max_running_requests,
        context_length=config.context_length,
        max_total_tokens=config.max_total_tokens,
        min_bucket=config.min_bucket,
    )


def check_fits(
    model: Qwen3MoeConfig, layout: CacheLayout, dtype: str, budget: float | None = None
) -> None:
    """Raises `EngineError` when the weights (twice: a refit) and the KV cache exceed what this
    process's device may hold (its allocator's limit: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of a
    GPU), or ``budget`` bytes where given (a colocated server's share); no check where the
    platform reports no limit (the CPU)."""  # noqa: D205, D209
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if budget is not None and limit is not None:
        limit = min(limit, budget)
    problem = fit_problem(server_memory(model, layout, dtype), limit)
    if problem is not None:
        raise EngineError(
            f"the server {problem} ({layout.slots} slots x {layout.slot_len} tokens, {dtype}): "
            "lower --max-running-requests or --context-length, --dtype bfloat16, or give it a "
            "larger share of the device (XLA_PYTHON_CLIENT_MEM_FRACTION)"
        )

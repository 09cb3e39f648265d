"""The embedded server's read-only endpoints, in SGLang 0.5.23's response shapes.

- ``GET /model_info`` (``/get_model_info``) and ``/server_info`` (``/get_server_info``);
- ``GET /v1/models`` and ``/v1/models/{model}``: OpenAI's model list (SGLang's
  ``entrypoints/http_server.py`` ``available_models``; ``sglang.utils.wait_for_server`` polls it,
  so it answers 503 until the engine is ready). `model_cards` is the one place that lists what
  is served, for the OpenAI-compatible routes to reuse;
- ``GET /v1/loads``: SGLang's per-DP-rank load snapshot (``entrypoints/v1_loads.py``,
  ``managers/load_snapshot.py``), which slime polls to wait for an idle server.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
from aiohttp import web

from osworld_jax.server.http_base import ARGS_KEY, VERSION, error_response, ready_engine

#: ``/v1/loads?include=`` sections SGLang accepts.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def served_model_name(app: web.Application, engine: Any) -> str:
    """``--served-model-name``, else the model path the server started with (as SGLang)."""
    return str(app[ARGS_KEY].get("served_model_name") or engine.config.model_path)


def model_cards(app: web.Application, engine: Any) -> list[dict[str, Any]]:
    """OpenAI model cards of what is served (one base model; no LoRA adapters)."""
    name = served_model_name(app, engine)
    return [
        {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": engine.context_length,
        }
    ]


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: ``{"object": "list", "data": [model card]}``."""
    engine = ready_engine(request)
    return web.json_response({"object": "list", "data": model_cards(request.app, engine)})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the card, or OpenAI's 404 ``model_not_found``."""
    engine = ready_engine(request)
    name = request.match_info["model"]
    for card in model_cards(request.app, engine):
        if card["id"] == name:
            return web.json_response(card)
    return web.json_response(
        {
            "error": {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        },
        status=404,
    )


def load_snapshot(engine: Any, sections: set[str] | None) -> dict[str, Any]:
    """One SGLang ``LoadSnapshot.to_dict`` of the engine (read between engine steps)."""
    running = [r for r in engine.slots if r is not None]
    used = sum(len(r.input_ids) + len(r.output_ids) for r in running)
    waiting = sum(len(r.input_ids) + len(r.output_ids) for r in engine.waiting)
    capacity = engine.runner.num_slots * engine.runner.slot_len
    load: dict[str, Any] = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": len(running),
        "num_waiting_reqs": len(engine.waiting),
        "num_waiting_uncached_tokens": waiting,
        "num_used_tokens": used,
        "num_total_tokens": used + waiting,
        "num_active_tokens": used + waiting,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": engine.runner.num_slots,
        "token_usage": round(used / capacity, 4) if capacity else 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": round(len(running) / engine.runner.num_slots, 4),
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }
    if sections is None or "all" in sections or "memory" in sections:
        leaves = [engine.runner.params, engine.runner.cache]
        sizes = [sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in _leaves(t)) for t in leaves]
        load["memory"] = {
            "weight_gb": round(sizes[0] / 2**30, 3),
            "kv_cache_gb": round(sizes[1] / 2**30, 3),
            "graph_gb": 0.0,
            "token_capacity": capacity,
        }
    if sections is None or "all" in sections or "queues" in sections:
        load["queues"] = {
            "waiting": len(engine.waiting),
            "grammar": 0,
            "paused": len(running) + len(engine.waiting) if engine.paused else 0,
            "retracted": 0,
            "prealloc_ready": 0,
        }
    return load


def _leaves(tree: Any) -> list[Any]:
    import jax

    return list(jax.tree.leaves(tree))


async def loads(request: web.Request) -> web.Response:
    """``GET /v1/loads[?include=core,queues,...][&dp_rank=0][&format=prometheus]``."""
    engine = ready_engine(request)
    include = request.query.get("include")
    sections = {s.strip() for s in include.split(",")} if include else None
    if sections is not None and not sections <= set(LOAD_SECTIONS):
        bad = sorted(sections - set(LOAD_SECTIONS))
        return error_response(
            400, f"Invalid include sections: {bad}. Valid options: {sorted(LOAD_SECTIONS)}"
        )
    dp_rank = request.query.get("dp_rank")
    if dp_rank is not None and not dp_rank.lstrip("-").isdigit():
        return error_response(400, f"dp_rank must be an integer, got {dp_rank!r}")
    snapshot = await asyncio.wrap_future(engine.call(lambda: load_snapshot(engine, sections)))
    snapshots = [snapshot] if dp_rank in (None, "0") else []
    if request.query.get("format") == "prometheus":
        lines = []
        for key, value in snapshot.items() if snapshots else ():
            groups = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, v in groups:
                if isinstance(v, int | float) and not isinstance(v, bool):
                    name = f"sglang_{key}" if sub is None else f"sglang_{key}_{sub}"
                    lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {v}']
        return web.Response(
            text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8"
        )
    return web.json_response(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": VERSION,
            "accelerator": _accelerator(),
            "num_accelerators": 1,
            "loads": snapshots,
        }
    )


def _accelerator() -> str | None:
    import jax

    device = jax.devices()[0]
    return None if device.platform == "cpu" else str(device.device_kind)


async def model_info(request: web.Request) -> web.Response:
    """``GET /model_info`` (and the deprecated ``/get_model_info``)."""
    engine = ready_engine(request)
    vision = engine.processor is not None
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": None if engine.tokenizer is None else engine.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": vision,
            "has_audio_understanding": False,
            "model_type": "qwen3_vl_moe" if vision else "qwen3_moe",
            "architectures": [
                "Qwen3VLMoeForConditionalGeneration" if vision else "Qwen3MoeForCausalLM"
            ],
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """``GET /server_info``: the server args, limits and version."""
    engine = ready_engine(request)
    return web.json_response(
        {
            **request.app[ARGS_KEY],
            "version": VERSION,
            "served_model_name": served_model_name(request.app, engine),
            "weight_version": engine.weight_version,
            "return_original_logprob": engine.config.return_original_logprob,
            "skip_tokenizer_init": engine.tokenizer is None,
            "context_length": engine.context_length,
            "max_running_requests": engine.runner.num_slots,
            "max_total_num_tokens": engine.runner.num_slots * engine.runner.slot_len,
            "num_decode_steps": engine.num_decode_steps,
            "num_generated_tokens": engine.num_generated_tokens,
            "prefill_seconds": round(engine.prefill_seconds, 6),
            "decode_seconds": round(engine.decode_seconds, 6),
        }
    )


def add_routes(app: web.Application) -> None:
    """Registers the read-only endpoints on ``app``."""
    r = app.router
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model:.+}", retrieve_model)
    r.add_get("/v1/loads", loads)

"""Fixtures of the rollout tests: a tiny checkpoint, one shared in-process engine, HF helpers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest

# One engine shape for every in-process test: every test reuses the same compiled buckets
# (prefill 64, decode 8 slots x 64 or 128 positions).
ENGINE_KW = dict(
    max_running_requests=8,
    context_length=128,
    min_bucket=64,
    min_decode_batch=8,
    enable_return_routed_experts=True,
    dtype="float32",
)


def make_ckpt(path, seed: int):
    from osworld_jax.model.tiny import make_tiny_checkpoint

    # initializer_range 0.1: peaked next-token distributions, so greedy outputs of two seeds
    # differ and logprob comparisons are not between near-uniform values.
    return make_tiny_checkpoint(path, seed=seed, initializer_range=0.1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("tiny0"), seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("tiny1"), seed=1)


def start_engine(path, weight_version: str = "v0"):
    from osworld_jax.server.engine import Engine, EngineConfig

    cfg = EngineConfig(model_path=str(path), weight_version=weight_version, **ENGINE_KW)
    return Engine(cfg).start()


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    eng = start_engine(tiny_ckpt)
    yield eng
    eng.shutdown()


@contextlib.asynccontextmanager
async def serving(engine, limits=None) -> AsyncIterator[str]:
    """Serves ``engine`` over HTTP on 127.0.0.1:<free port> for the duration of the block."""
    from aiohttp import web

    from osworld_jax.server.app import build_app

    runner = web.AppRunner(build_app(engine, {"model_path": engine.model_path}, limits))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def hf_model(path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype="float32").eval()


def hf_logits_and_routes(model, ids: list[int]):
    """(logits f32[S, V], {layer: router logits f32[S, E]}) of the torch reference."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor([ids]), output_router_logits=True)
    cfg = model.config
    moe_layers = [
        i
        for i in range(cfg.num_hidden_layers)
        if i not in (cfg.mlp_only_layers or [])
        and cfg.num_experts > 0
        and (i + 1) % cfg.decoder_sparse_step == 0
    ]
    assert len(out.router_logits) == len(moe_layers)
    routers = {
        layer: r.float().numpy().reshape(len(ids), -1)
        for layer, r in zip(moe_layers, out.router_logits, strict=True)
    }
    return out.logits[0].float().numpy(), routers


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


# The Qwen3-VL engine of the image tests: 256-token context (one 1920x1080 screenshot is 144
# image tokens with the tiny processor), 4 slots.
VL_ENGINE_KW = dict(ENGINE_KW, max_running_requests=4, context_length=256, min_decode_batch=4)


@pytest.fixture(scope="session")
def vl_ckpt(tmp_path_factory):
    from osworld_jax.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_vl"), kind="qwen3_vl_moe", seed=0, initializer_range=0.1
    )


def start_vl_engine(path, weight_version: str = "v0"):
    from osworld_jax.server.engine import Engine, EngineConfig

    cfg = EngineConfig(model_path=str(path), weight_version=weight_version, **VL_ENGINE_KW)
    return Engine(cfg).start()


@pytest.fixture(scope="module")
def vl_engine(vl_ckpt):
    eng = start_vl_engine(vl_ckpt)
    yield eng
    eng.shutdown()


def hf_vl_model(path):
    from transformers import Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype="float32").eval()


def hf_vl_logits_and_routes(model, ids: list[int], pixel_values=None, grid=None):
    """(logits f32[S, V], {layer: router logits f32[S, E]}) of the transformers reference."""
    import torch

    cfg = model.config
    arr = np.asarray([ids])
    kw = {}
    if pixel_values is not None:
        kw = dict(
            pixel_values=torch.as_tensor(pixel_values),
            image_grid_thw=torch.as_tensor(grid),
            mm_token_type_ids=torch.as_tensor((arr == cfg.image_token_id).astype(np.int64)),
        )
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(arr), output_router_logits=True, **kw)
    text = cfg.text_config
    moe_layers = [
        i
        for i in range(text.num_hidden_layers)
        if i not in (text.mlp_only_layers or []) and (i + 1) % text.decoder_sparse_step == 0
    ]
    assert len(out.router_logits) == len(moe_layers)
    routers = {
        layer: r.float().numpy().reshape(len(ids), -1)
        for layer, r in zip(moe_layers, out.router_logits, strict=True)
    }
    return out.logits[0].float().numpy(), routers

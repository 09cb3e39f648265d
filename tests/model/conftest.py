"""Shared helpers of the model tests: tiny HF reference models built with transformers (torch)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.tiny import HF_TINY, RUNTIME, TINY

# The tests' tiny config (tests/tiny.py): layer 0 dense, layers 1-2 MoE.
TINY_CFG, TINY_RT = TINY, RUNTIME


@functools.cache
def tiny_policy():
    """A random float32 `Policy` of TINY_CFG (cached: tests must not mutate it)."""
    from flax import nnx

    from osworld_jax.model import Policy

    return Policy(TINY_CFG, TINY_RT, rngs=nnx.Rngs(0))


def build_hf_model(path, seed=0, **overrides):
    """A random transformers Qwen3MoeForCausalLM (non-trivial norms too), saved to ``path``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**HF_TINY, **overrides})
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_forward(model, ids, **kwargs):
    """(logits f32[B,S,V], router logits list of [B*S, E], aux_loss) from the torch model."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids)), output_router_logits=True, **kwargs)
    return (
        out.logits.float().numpy(),
        [r.float().numpy() for r in out.router_logits],
        float(out.aux_loss),
    )


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """(torch model, checkpoint dir) of the default tiny HF model."""
    path = tmp_path_factory.mktemp("hf_tiny")
    return build_hf_model(path), path


def jforward(policy_or_params, *args, config=None, runtime=None, **kwargs):
    """Jitted `forward` of a Policy (or of a params tree with config/runtime given)."""
    from osworld_jax.model import forward

    if config is None:
        config, runtime = policy_or_params.config, policy_or_params.runtime
        policy_or_params = policy_or_params.params()
    return _jitted(forward)(policy_or_params, config, runtime, *args, **kwargs)


def _jitted(fn, _cache={}):  # noqa: B006 - module-level memo of the jitted function
    import jax

    if fn not in _cache:
        _cache[fn] = jax.jit(
            fn, static_argnames=("config", "runtime", "return_logits"), static_argnums=(1, 2)
        )
    return _cache[fn]

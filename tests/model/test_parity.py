"""Parity with HF transformers' Qwen3MoeForCausalLM (the independent reference), float32."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import load_hf_checkpoint
from tests.model.conftest import build_hf_model, hf_forward, jforward, rel_err


def _ids(b=3, s=24, v=96, seed=0):
    return np.random.RandomState(seed).randint(0, v, (b, s)).astype(np.int32)


def _hf_topk(router_logits, k):
    probs = np.exp(router_logits - router_logits.max(-1, keepdims=True))
    return np.sort(np.argsort(-probs, axis=-1, kind="stable")[:, :k], axis=-1)


def test_logits_and_routes_match_hf(hf_tiny):
    model, path = hf_tiny
    policy = load_hf_checkpoint(path, dtype=jnp.float32)
    ids = _ids()
    ref_logits, ref_router, ref_aux = hf_forward(model, ids)
    out = jforward(policy, jnp.asarray(ids))
    chex.assert_shape(out.logits, (3, 24, 96))
    chex.assert_type(out.logits, jnp.float32)
    err = rel_err(out.logits, ref_logits)
    print(f"HF parity: logits rel Frobenius error {err:.3e}")
    assert err < 1e-4
    cfg = policy.config
    routed = np.asarray(out.routed_experts)  # [B, S, L, K]
    chex.assert_shape(routed, (3, 24, cfg.num_hidden_layers, cfg.num_experts_per_tok))
    agree, total = 0, 0
    for m, layer in enumerate(cfg.moe_layers):
        ours = np.sort(routed[:, :, layer].reshape(-1, cfg.num_experts_per_tok), axis=-1)
        theirs = _hf_topk(ref_router[m], cfg.num_experts_per_tok)
        agree += int((ours == theirs).all(-1).sum())
        total += ours.shape[0]
    print(f"HF parity: routed experts agree on {agree}/{total} (token, layer) pairs")
    assert agree / total >= 0.999
    for layer in cfg.dense_layers:
        assert (routed[:, :, layer] == -1).all()
    # HF's load_balancing_loss_func (no attention mask) = ours with all tokens valid.
    np.testing.assert_allclose(float(out.aux["load_balancing_loss"]), ref_aux, rtol=1e-5)


def test_packed_positions_match_hf_position_ids(hf_tiny):
    """Explicit positions (offset start) give HF's logits for the same position_ids."""
    import torch

    model, path = hf_tiny
    policy = load_hf_checkpoint(path, dtype=jnp.float32)
    ids = _ids(2, 16, seed=1)
    pos = np.broadcast_to(np.arange(7, 23), (2, 16)).astype(np.int32)
    ref, _, _ = hf_forward(model, ids, position_ids=torch.as_tensor(pos, dtype=torch.long))
    out = jforward(policy, jnp.asarray(ids), positions=jnp.asarray(pos))
    assert rel_err(out.logits, ref) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500000.0,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_and_tied_embeddings_match_hf(tmp_path, rope):
    model = build_hf_model(
        tmp_path, seed=3, rope_parameters=rope, tie_word_embeddings=True, num_hidden_layers=2
    )
    policy = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    assert policy.config.rope_scaling_dict["rope_type"] == rope["rope_type"]
    assert policy.config.tie_word_embeddings
    ids = _ids(2, 40, seed=2)
    ref, _, _ = hf_forward(model, ids)
    assert rel_err(jforward(policy, jnp.asarray(ids)).logits, ref) < 1e-4


def test_bfloat16_precision_policy(hf_tiny):
    """bf16 params/activations; float32 logits; close to the float32 model."""
    _, path = hf_tiny
    p32 = load_hf_checkpoint(path, dtype=jnp.float32)
    p16 = load_hf_checkpoint(path)  # default bfloat16
    assert p16.runtime.dtype == "bfloat16"
    assert p16.params()["attn"]["q_proj"].dtype == jnp.bfloat16
    ids = jnp.asarray(_ids())
    o16, o32 = jforward(p16, ids), jforward(p32, ids)
    chex.assert_type(o16.logits, jnp.float32)
    chex.assert_type(o16.hidden, jnp.bfloat16)
    assert rel_err(o16.logits, o32.logits) < 5e-2

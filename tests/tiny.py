"""The tiny Qwen3-MoE of the tests, defined once; a test's variant is a ``.replace(...)`` of it.

3 layers (layer 0 dense, layers 1-2 MoE with top-2 of 8 experts), every dimension divisible by 2
so that the 8-device CPU mesh of the sharding tests splits it; float32 with the dense reference
expert backend. ``TINY_HF`` is its variant for the transformers reference models of the model
tests (``HF_TINY``: its ``transformers.Qwen3MoeConfig`` keyword arguments). The default run's model
is ``osworld_jax.model.tiny`` (a larger vocabulary, built with its tokenizer), not this one.
"""

from __future__ import annotations

from typing import Any

from osworld_jax.model import ModelRuntimeConfig, Qwen3MoeConfig

TINY = Qwen3MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=(0,),
    initializer_range=0.2,
)
RUNTIME = ModelRuntimeConfig(dtype="float32", expert_backend="dense")
#: The HF reference models' variant: another vocabulary and layer layout (layer 1 dense).
TINY_HF = TINY.replace(
    vocab_size=96, mlp_only_layers=(1,), initializer_range=0.1, max_position_embeddings=256
)

_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "initializer_range",
    "rope_theta",
    "max_position_embeddings",
)


def hf_kwargs(config: Qwen3MoeConfig = TINY, **overrides: Any) -> dict[str, Any]:
    """``transformers.Qwen3MoeConfig`` keyword arguments of ``config``'s architecture."""
    kwargs = {k: getattr(config, k) for k in _HF_KEYS}
    kwargs["mlp_only_layers"] = list(config.mlp_only_layers)
    return kwargs | overrides


#: ``transformers.Qwen3MoeConfig`` keyword arguments of ``TINY_HF`` (tests/model/conftest.py).
HF_TINY = hf_kwargs(TINY_HF)

"""Config parsing: both HF layouts, round trip through transformers, clear errors."""

from __future__ import annotations

import json

import pytest

from osworld_jax.model import ModelConfigError, ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.config import SUPPORTED_ROPE_TYPES

BASE = dict(
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
)


def test_legacy_and_v5_layouts_parse_to_the_same_config():
    legacy = {
        **BASE,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "max_position_embeddings": 131072,
    }
    v5 = {
        **{k: v for k, v in BASE.items() if k != "num_experts"},
        "num_local_experts": 8,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 5e5,
            "original_max_position_embeddings": 32768,
        },
    }
    a, b = Qwen3MoeConfig.from_hf_dict(legacy), Qwen3MoeConfig.from_hf_dict(v5)
    assert a == b
    assert a.head_dim == 8  # hidden_size // num_attention_heads when absent
    assert a.rope_scaling_dict == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert Qwen3MoeConfig.from_hf_dict(a.to_hf_dict()) == a
    hash(a)  # hashable: usable as a jit static argument


def test_decoder_sparse_step_and_mlp_only_layers_pick_dense_layers():
    c = Qwen3MoeConfig.from_hf_dict({**BASE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert c.moe_layers == (1,) and c.dense_layers == (0, 2, 3)


def test_to_hf_dict_loads_in_transformers(tmp_path):
    from transformers import AutoConfig

    c = Qwen3MoeConfig.from_hf_dict(
        {
            **BASE,
            "mlp_only_layers": [0],
            "eos_token_id": 5,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }
    )
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_dict()))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "qwen3_moe" and hf.num_experts == 8 and hf.mlp_only_layers == [0]
    assert hf.rope_parameters["rope_type"] == "linear" and hf.rope_parameters["factor"] == 2.0
    assert Qwen3MoeConfig.from_hf_dict(hf.to_dict()) == c


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "qwen2_moe"}, "model_type"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "sliding"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_unsupported_values_raise_naming_the_key(change, match):
    d = {**BASE, **change}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ModelConfigError, match=match):
        Qwen3MoeConfig.from_hf_dict(d)


def test_from_json_names_the_file(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**BASE, "model_type": "llama"}))
    with pytest.raises(ModelConfigError, match=str(f)):
        Qwen3MoeConfig.from_json(tmp_path)
    with pytest.raises(ModelConfigError, match="no such"):
        Qwen3MoeConfig.from_json(tmp_path / "missing.json")


def test_runtime_config_validates_against_registries():
    assert "yarn" in SUPPORTED_ROPE_TYPES
    with pytest.raises(ModelConfigError, match="expert_backend"):
        ModelRuntimeConfig(expert_backend="megablox")
    with pytest.raises(ModelConfigError, match="remat"):
        ModelRuntimeConfig(remat="sometimes")
    with pytest.raises(ModelConfigError, match="dtype"):
        ModelRuntimeConfig(dtype="float16")


QWEN3_30B_A3B = {  # the public config.json of Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_parameter_count_and_sharding():
    import math

    from jax.sharding import PartitionSpec as P

    from osworld_jax.model import make_mesh, param_shardings
    from osworld_jax.model.params import param_specs

    c = Qwen3MoeConfig.from_hf_dict(QWEN3_30B_A3B)
    assert c.moe_layers == tuple(range(48)) and c.dense_layers == ()
    total = sum(math.prod(s.shape) for s in param_specs(c).values())
    assert abs(total - 30.53e9) / 30.53e9 < 0.005, total  # "30.5B total parameters"
    sh = param_shardings(c, make_mesh(fsdp=2, expert=2, tensor=2))
    assert sh["moe"]["gate"].spec == P(None, "expert", "fsdp", "tensor")
    assert sh["attn"]["k_proj"].spec == P(None, "fsdp", "tensor", None)
    assert sh["top"]["lm_head"].spec == P("fsdp", "tensor")


def test_runtime_attention_kernels_are_validated_and_the_vit_follows_attention_unless_set():
    from osworld_jax.model.vision import fused_vision_attention

    for key in ("attention", "vision_attention"):
        with pytest.raises(ModelConfigError, match=rf"ModelRuntimeConfig.{key}: 'flash'; choose"):
            ModelRuntimeConfig(**{key: "flash"})
    # On this CPU the packed cuDNN kernel is never chosen, whatever is asked for.
    assert not fused_vision_attention(ModelRuntimeConfig(dtype="bfloat16", attention="cudnn"))
    assert ModelRuntimeConfig(vision_attention="cudnn").vision_attention == "cudnn"
    assert ModelRuntimeConfig().vision_attention is None

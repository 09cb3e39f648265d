"""HF checkpoint I/O: save -> transformers from_pretrained, both expert layouts, shards, tiny."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from osworld_jax.model import (
    CheckpointError,
    load_hf_checkpoint,
    make_tiny_checkpoint,
    save_hf_checkpoint,
)
from osworld_jax.model.safetensors_io import SafetensorsFile, write_safetensors
from tests.model.conftest import hf_forward, jforward, rel_err


def _ids(b=2, s=20, v=96, seed=0):
    return np.random.RandomState(seed).randint(0, v, (b, s)).astype(np.int32)


def _from_pretrained(path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype="float32").eval()


def test_save_then_hf_from_pretrained_same_logits(hf_tiny, tmp_path):
    _, path = hf_tiny
    policy = load_hf_checkpoint(path, dtype=jnp.float32)
    out = save_hf_checkpoint(policy, tmp_path / "export")
    assert out == tmp_path / "export"
    assert not list(tmp_path.glob("export.tmp-*"))  # atomic: no temp dir left behind
    names = SafetensorsFile(out / "model.safetensors").names()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names  # per-expert layout
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    ids = _ids()
    ref, _, _ = hf_forward(_from_pretrained(out), ids)
    assert rel_err(jforward(policy, jnp.asarray(ids)).logits, ref) < 1e-5
    # Saving again over the same path replaces it atomically and reloads identically.
    save_hf_checkpoint(policy, out)
    again = load_hf_checkpoint(out, dtype=jnp.float32)
    np.testing.assert_array_equal(again.params()["moe"]["gate"], policy.params()["moe"]["gate"])


def test_bfloat16_export_is_bf16_on_disk_and_matches_hf(hf_tiny, tmp_path):
    _, path = hf_tiny
    out = save_hf_checkpoint(load_hf_checkpoint(path), tmp_path / "bf16")  # bf16 params
    f = SafetensorsFile(out / "model.safetensors")
    assert f.get("model.layers.2.mlp.experts.3.up_proj.weight").dtype == jnp.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ids = _ids(seed=4)
    ref, _, _ = hf_forward(_from_pretrained(out), ids)  # HF upcasts the bf16 weights to f32
    ours = load_hf_checkpoint(out, dtype=jnp.float32)
    assert rel_err(jforward(ours, jnp.asarray(ids)).logits, ref) < 1e-4


def test_fused_expert_layout_and_sharded_index(hf_tiny, tmp_path):
    """HF's in-memory fused layout (gate_up_proj / down_proj), split over 2 indexed shards."""
    model, path = hf_tiny
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)  # transformers 5.x modules
    keys = sorted(sd)
    half = len(keys) // 2
    shards = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    for fname, names in shards.items():
        write_safetensors(tmp_path / fname, {k: sd[k] for k in names})
    index = {"weight_map": {k: f for f, names in shards.items() for k in names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fused = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    ref = load_hf_checkpoint(path, dtype=jnp.float32)
    for group, values in ref.params().items():
        for name, v in values.items():
            np.testing.assert_array_equal(fused.params()[group][name], v, err_msg=f"{group}.{name}")


@pytest.mark.slow
def test_sharded_save_roundtrip(hf_tiny, tmp_path):
    _, path = hf_tiny
    policy = load_hf_checkpoint(path, dtype=jnp.float32)
    save_hf_checkpoint(policy, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = load_hf_checkpoint(tmp_path / "sharded", dtype=jnp.float32)
    ids = jnp.asarray(_ids())
    np.testing.assert_array_equal(jforward(back, ids).logits, jforward(policy, ids).logits)


def test_missing_tensor_raises(hf_tiny, tmp_path):
    _, path = hf_tiny
    f = SafetensorsFile(path / "model.safetensors")
    keep = {n: np.array(f.get(n)) for n in f.names() if "layers.2.self_attn.k_norm" not in n}
    write_safetensors(tmp_path / "model.safetensors", keep)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="layers.2.self_attn.k_norm"):
        load_hf_checkpoint(tmp_path, dtype=jnp.float32)


def test_tiny_checkpoint_numpy_path_loads_in_hf_and_is_deterministic(tmp_path):
    import time

    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    a = make_tiny_checkpoint(tmp_path / "a", seed=7, initializer_range=0.1)
    assert time.perf_counter() - t0 < 5.0
    b = make_tiny_checkpoint(tmp_path / "b", seed=7, initializer_range=0.1)
    c = make_tiny_checkpoint(tmp_path / "c", seed=8, initializer_range=0.1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [0] and cfg["num_experts"] == 8
    assert cfg["num_experts_per_tok"] == 2
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.eos_token == "<|im_end|>" and cfg["eos_token_id"] == tok.eos_token_id
    assert len(tok) <= cfg["vocab_size"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Open the terminal"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|im_start|>user\nOpen the terminal<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # The numpy-written checkpoint is the same function in HF and in our policy.
    policy = load_hf_checkpoint(a, dtype=jnp.float32)
    batch = np.asarray([ids[:12], ids[-12:]], np.int32)
    ref, _, _ = hf_forward(_from_pretrained(a), batch)
    assert rel_err(jforward(policy, jnp.asarray(batch)).logits, ref) < 1e-4


def test_large_random_checkpoints_are_drawn_in_parallel_deterministically(monkeypatch):
    # Above PARALLEL_DRAW_PARAMS (set to 0 here: the tiny model counts as large) every normal
    # tensor is drawn in 2^22-value chunks on all cores: the same seed gives the same values,
    # another seed others, each tensor at its init std; ones / zeros stay exact.
    from osworld_jax.model import tiny
    from osworld_jax.model.params import param_specs

    config = tiny.tiny_config(512, 1, initializer_range=0.1)
    serial = tiny.random_params(config, 3)
    monkeypatch.setattr(tiny, "PARALLEL_DRAW_PARAMS", 0)
    a, b, c = (tiny.random_params(config, s) for s in (3, 3, 4))
    for key, spec in param_specs(config).items():
        group, name = key.split(".")
        x = a[group][name]
        assert x.dtype == np.float32 and x.shape == spec.shape
        np.testing.assert_array_equal(x, b[group][name])
        if spec.init in ("ones", "zeros"):
            np.testing.assert_array_equal(x, serial[group][name])
            continue
        assert not np.array_equal(x, c[group][name])
        if x.size >= 4096:
            std = config.initializer_range if spec.std is None else spec.std
            assert abs(float(x.std()) / std - 1.0) < 0.1, key
    big = tiny._parallel_normal((3, 1 << 22), 1.0, np.random.SeedSequence(0))  # 3 chunks
    assert not np.array_equal(big[0], big[1]) and abs(float(big.std()) - 1.0) < 1e-3
    wide = np.linspace(-3, 3, (1 << 24) + 5, dtype=np.float32)  # the parallel bf16 cast
    np.testing.assert_array_equal(tiny._bfloat16(wide), wide.astype(ml_dtypes.bfloat16))

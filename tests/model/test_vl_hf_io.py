"""Qwen3-VL-MoE checkpoints in and out: both fused layouts, per-expert, shards, mesh, tiny."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import (
    CheckpointError,
    ImageProcessor,
    ModelConfigError,
    load_hf_checkpoint,
    make_mesh,
    make_tiny_checkpoint,
    mrope_positions,
    save_hf_checkpoint,
)
from osworld_jax.model.safetensors_io import SafetensorsFile, write_safetensors
from tests.model.conftest import jforward, rel_err
from tests.model.test_processor import SCREENSHOT
from tests.model.vl_helpers import build_hf_vl_model


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vl"), kind="qwen3_vl_moe", seed=1)


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """A checkpoint transformers 5.x itself saved (fused experts in its in-memory layout)."""
    path = tmp_path_factory.mktemp("hf_vl_io")
    build_hf_vl_model(path, seed=1)
    return path


def _from_pretrained(path):
    from transformers import Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype="float32").eval()


def _screenshot_prompt(path):
    """(ids [1, S], pixel_values, grid) of a chat with the sandbox screenshot, via the files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    pixel_values, grid = ImageProcessor.from_pretrained(path)(SCREENSHOT.read_bytes())
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click OK"}]}
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * int(grid.prod() // 4))
    return np.array([tok(text)["input_ids"]], np.int32), pixel_values, grid


def _ours(policy, ids, pixel_values, grid):
    pos = mrope_positions(ids, grid, policy.config)
    return jforward(
        policy,
        jnp.asarray(ids),
        positions=jnp.asarray(pos),
        pixel_values=jnp.asarray(pixel_values),
        image_grid_thw=jnp.asarray(grid),
    ).logits


def _hf(model, ids, pixel_values, grid):
    import torch

    with torch.no_grad():
        return model(
            input_ids=torch.as_tensor(ids),
            pixel_values=torch.as_tensor(pixel_values),
            image_grid_thw=torch.as_tensor(grid),
            mm_token_type_ids=torch.as_tensor((ids == model.config.image_token_id).astype(int)),
        ).logits.numpy()


def _assert_same_params(a, b):
    pa, pb = jax.device_get(a.params()), jax.device_get(b.params())
    assert pa.keys() == pb.keys()
    for group, values in pa.items():
        for name, v in values.items():
            np.testing.assert_array_equal(pb[group][name], v, err_msg=f"{group}.{name}")


def test_save_then_transformers_loads_the_same_model(tiny_vl, tmp_path):
    policy = load_hf_checkpoint(tiny_vl, dtype=jnp.float32)
    out = save_hf_checkpoint(policy, tmp_path / "export", copy_files_from=tiny_vl)
    for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_vl / name).read_bytes(), name
    f = SafetensorsFile(out / "model.safetensors")
    e, h, i = 8, 64, 48  # the published fused layout: gate_up [E, H, 2I], down [E, I, H]
    assert f.get("model.language_model.layers.1.mlp.experts.gate_up_proj").shape == (e, h, 2 * i)
    assert f.get("model.language_model.layers.1.mlp.experts.down_proj").shape == (e, i, h)
    assert f.get("model.visual.patch_embed.proj.weight").shape == (32, 3, 2, 16, 16)
    ids, pixel_values, grid = _screenshot_prompt(out)
    ref = _hf(_from_pretrained(out), ids, pixel_values, grid)
    assert rel_err(_ours(policy, ids, pixel_values, grid), ref) <= 1e-5
    _assert_same_params(load_hf_checkpoint(out, dtype=jnp.float32), policy)


def test_transformers_layout_ours_and_per_expert_load_the_same(hf_saved, tmp_path):
    hf = load_hf_checkpoint(hf_saved, dtype=jnp.float32)
    ours = save_hf_checkpoint(hf, tmp_path / "ours", max_shard_bytes=30_000)
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded with an index
    _assert_same_params(load_hf_checkpoint(ours, dtype=jnp.float32), hf)
    # Per-expert names (what SGLang also accepts) from transformers' fused tensors.
    src = SafetensorsFile(hf_saved / "model.safetensors")
    tensors = {}
    for name in src.names():
        w = np.array(src.get(name))
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            for j, g in enumerate(w):
                tensors[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = g[:12]
                tensors[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = g[12:]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            for j, d in enumerate(w):
                tensors[name.replace("down_proj", f"{j}.down_proj.weight")] = d
        else:
            tensors[name] = w
    (tmp_path / "per_expert").mkdir()
    write_safetensors(tmp_path / "per_expert" / "model.safetensors", tensors)
    (tmp_path / "per_expert" / "config.json").write_text((hf_saved / "config.json").read_text())
    _assert_same_params(load_hf_checkpoint(tmp_path / "per_expert", dtype=jnp.float32), hf)


def test_mesh_load_builds_sharded_vision_params(hf_saved):
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    plain = load_hf_checkpoint(hf_saved, dtype=jnp.float32)
    sharded = load_hf_checkpoint(hf_saved, dtype=jnp.float32, mesh=mesh)
    qkv = sharded.params()["vision_blocks"]["qkv"]  # [Lv, Hv, 3, Nh, Dh] = [3, 16, 3, 2, 8]
    assert {s.data.shape for s in qkv.addressable_shards} == {(3, 8, 3, 1, 8)}
    chex.assert_trees_all_equal(jax.device_get(sharded.params()), jax.device_get(plain.params()))


def test_wrong_tensor_shapes_and_missing_tensors_name_them(hf_saved, tmp_path):
    src = SafetensorsFile(hf_saved / "model.safetensors")
    tensors = {n: np.array(src.get(n)) for n in src.names()}
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][:, :20]
    del tensors["model.visual.blocks.2.attn.qkv.bias"]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text((hf_saved / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"gate_up_proj: shape \(8, 20, 32\)"):
        load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    del tensors[name]
    tensors[name] = np.array(src.get(name))
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="model.visual.blocks.2.attn.qkv.bias"):
        load_hf_checkpoint(tmp_path, dtype=jnp.float32)


def test_tiny_vl_checkpoint_files(tiny_vl, tmp_path):
    from transformers import AutoTokenizer

    from osworld_jax.agent import ChatTemplate

    again = make_tiny_checkpoint(tmp_path / "again", kind="qwen3_vl_moe", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_vl / name).read_bytes(), name
    cfg = json.loads((tiny_vl / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_vl)
    for key, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        assert tok.convert_tokens_to_ids(token) == cfg[key] and token in tok.all_special_tokens
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You operate a desktop."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "image": "a.png"},
                {"type": "video", "video": "b.mp4"},
            ],
        },
        {"role": "assistant", "content": "Done."},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou operate a desktop.<|im_end|>\n<|im_start|>user\nLook:"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ChatTemplate.from_model_dir(tiny_vl).render(messages, add_generation_prompt=True) == text
    numbered = tok.apply_chat_template(messages[1:2], tokenize=False, add_vision_id=True)
    assert "Picture 1: <|vision_start|>" in numbered and "Video 1: <|vision_start|>" in numbered
    p = ImageProcessor.from_pretrained(tiny_vl)
    assert p.num_image_tokens(1080, 1920) == 144  # 288 x 512 pixels: 18 x 32 patches / 4


def test_tiny_vl_refuses_square_fused_experts_and_unknown_kinds(tmp_path):
    with pytest.raises(ModelConfigError, match="square"):
        make_tiny_checkpoint(tmp_path / "sq", kind="qwen3_vl_moe", moe_intermediate_size=32)
    with pytest.raises(ModelConfigError, match="kind 'qwen2_vl'"):
        make_tiny_checkpoint(tmp_path / "k", kind="qwen2_vl")
    with pytest.raises(ModelConfigError, match="need kind='qwen3_vl_moe'"):
        make_tiny_checkpoint(tmp_path / "v", vision={"depth": 2})


def test_bfloat16_vl_model_follows_the_precision_policy(tiny_vl):
    """bf16 params/activations (the ViT included); float32 logits; close to the f32 model."""
    p16 = load_hf_checkpoint(tiny_vl)  # default bfloat16
    p32 = load_hf_checkpoint(tiny_vl, dtype=jnp.float32)
    assert p16.params()["vision_blocks"]["qkv"].dtype == jnp.bfloat16
    ids, pixel_values, grid = _screenshot_prompt(tiny_vl)
    o16 = _ours(p16, ids, pixel_values, grid)
    chex.assert_type(o16, jnp.float32)
    assert rel_err(o16, _ours(p32, ids, pixel_values, grid)) < 5e-2


@pytest.mark.parametrize("inter", [16, 32], ids=["H=2I", "H=I"])
def test_square_fused_experts_saved_by_transformers_load_exactly(tmp_path, inter):
    """transformers' own layout ([E, 2I, H] / [E, H, I]) with one tensor square per layer:
    the other tensor decides; logits equal transformers', and our export loads back."""  # noqa: D205, D209
    from tests.model.vl_helpers import PROCESSOR, hf_logits, images, prompt

    model = build_hf_vl_model(tmp_path / "hf", seed=3, text={"moe_intermediate_size": inter})
    f = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    gate_up = f.get("model.language_model.layers.0.mlp.experts.gate_up_proj").shape
    down = f.get("model.language_model.layers.0.mlp.experts.down_proj").shape
    assert (gate_up, down) == ((8, 2 * inter, 32), (8, 32, inter))  # transformers' in-memory
    assert gate_up[1] == gate_up[2] or down[1] == down[2]  # one of them square
    pixel_values, grid = PROCESSOR(images(4, [(24, 40), (16, 16)]))
    ids = np.array([prompt(np.random.RandomState(4), grid)], np.int32)
    text_ids = np.array([prompt(np.random.RandomState(5), grid[:0], text=(12, 0))], np.int32)
    ref, _ = hf_logits(model, ids, pixel_values, grid)
    ref_text, _ = hf_logits(model, text_ids)
    ours = load_hf_checkpoint(tmp_path / "hf", dtype=jnp.float32)
    assert rel_err(_ours(ours, ids, pixel_values, grid), ref) <= 1e-4
    assert rel_err(jforward(ours, jnp.asarray(text_ids)).logits, ref_text) <= 1e-4
    out = save_hf_checkpoint(ours, tmp_path / "export")  # square: transformers' layout
    f = SafetensorsFile(out / "model.safetensors")
    assert f.get("model.language_model.layers.0.mlp.experts.down_proj").shape == (8, 32, inter)
    again, _ = hf_logits(_from_pretrained(out), ids, pixel_values, grid)
    assert rel_err(again, ref) <= 1e-4
    _assert_same_params(load_hf_checkpoint(out, dtype=jnp.float32), ours)


def test_fused_experts_in_two_layouts_are_refused_naming_both(tmp_path):
    build_hf_vl_model(tmp_path / "hf", seed=3)  # H = 32, I = 12: both shapes decide alone
    src = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    tensors = {n: np.array(src.get(n)) for n in src.names()}
    down = "model.language_model.layers.2.mlp.experts.down_proj"
    tensors[down] = np.ascontiguousarray(np.swapaxes(tensors[down], 1, 2))  # published, alone
    (tmp_path / "mixed").mkdir()
    write_safetensors(tmp_path / "mixed" / "model.safetensors", tensors)
    (tmp_path / "mixed" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(tmp_path / "mixed", dtype=jnp.float32)
    msg = str(e.value)
    assert "\n" not in msg and "different fused expert layouts" in msg
    assert "layers.2.mlp.experts.gate_up_proj (8, 24, 32)" in msg and f"{down} (8, 12, 32)" in msg

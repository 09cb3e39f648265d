"""Qwen3-VL-MoE config: the published 30B-A3B config parses, counts 31.07B, round-trips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from osworld_jax.model import ModelConfigError, Qwen3MoeConfig, Qwen3VLMoeConfig
from osworld_jax.model.params import param_counts
from tests.model.vl_helpers import hf_vl_config, ours_config

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "osworld_jax/model/assets/qwen3_vl_30b_a3b_instruct"


def test_published_30b_a3b_config_parses():
    c = Qwen3MoeConfig.from_json(BUNDLED / "config.json")  # dispatches on model_type
    assert isinstance(c, Qwen3VLMoeConfig)
    assert (c.num_hidden_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok) == (
        48,
        2048,
        128,
        8,
    )
    assert c.moe_layers == tuple(range(48)) and c.norm_topk_prob and not c.tie_word_embeddings
    assert c.rope_theta == 5e6 and c.rope_scaling is None and c.mrope_section == (24, 20, 20)
    v = c.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.patch_size, v.out_hidden_size) == (
        27,
        1152,
        16,
        16,
        2048,
    )
    assert v.deepstack_visual_indexes == (8, 16, 24) and v.grid_side == 48
    assert (c.image_token_id, c.vision_start_token_id, c.vision_end_token_id) == (
        151655,
        151652,
        151653,
    )
    hash(c)  # a jit static argument
    assert Qwen3MoeConfig.from_hf_dict(c.to_hf_dict()) == c


def test_mrope_axes_interleave_like_hf():
    axes = Qwen3MoeConfig.from_json(BUNDLED / "config.json").mrope_axes  # head_dim 128: 64
    # HF: h takes slice(1, 60, 3), w slice(2, 60, 3), t everything else (0, 3, ..., 57, 60..63).
    assert axes[:6] == (0, 1, 2, 0, 1, 2) and axes[57:] == (0, 1, 2, 0, 0, 0, 0)
    assert [axes.count(i) for i in range(3)] == [24, 20, 20]


def test_parameter_count_matches_transformers_and_the_published_size():
    """31,070,754,032 parameters: HF's model on the meta device and the hub's "31.07B"."""
    import torch
    from transformers import Qwen3VLMoeConfig as HFConfig
    from transformers import Qwen3VLMoeForConditionalGeneration

    c = Qwen3MoeConfig.from_json(BUNDLED / "config.json")
    counts = param_counts(c)
    hf_cfg = HFConfig(**json.loads((BUNDLED / "config.json").read_text()))
    with torch.device("meta"):
        hf = Qwen3VLMoeForConditionalGeneration(hf_cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters()) == 31_070_754_032
    assert round(counts["total"] / 1e9, 2) == 31.07
    # Active per token: all but 120 of the 128 experts of each of the 48 MoE layers,
    # 48 * 120 * 3 * 2048 * 768 = 27.18B, gone from the 30.53B language model: 3.35B.
    assert counts["language"] - counts["active"] == 48 * 120 * 3 * 2048 * 768
    assert round(counts["active"] / 1e9, 2) == 3.35
    assert round(counts["vision"] / 1e9, 2) == 0.54


def test_param_count_script_prints_the_table():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/param_count.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "31.071B" in out and "3.353B" in out and "0.539B" in out


def test_transformers_reads_what_we_write(tmp_path):
    from transformers import AutoConfig

    c = ours_config()
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_dict()))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "qwen3_vl_moe" and hf.text_config.num_experts == 8
    assert hf.text_config.rope_parameters["mrope_section"] == [2, 1, 1]
    assert hf.vision_config.deepstack_visual_indexes == [0, 2]
    assert Qwen3MoeConfig.from_hf_dict(hf.to_dict()) == c


def test_hf_quirks_are_followed():
    # The router always renormalises: a text_config norm_topk_prob false is not read by HF.
    d = hf_vl_config().to_dict()
    d["text_config"]["norm_topk_prob"] = False
    assert Qwen3VLMoeConfig.from_hf_dict(d).norm_topk_prob
    # Missing rope_theta / mrope_section take HF's Qwen3-VL defaults (500000, [24, 20, 20]);
    # the top-level tie_word_embeddings decides, not the text config's.
    d = hf_vl_config().to_dict()
    d["text_config"].pop("rope_parameters")
    d["text_config"]["head_dim"] = 128
    d["text_config"]["tie_word_embeddings"] = True
    d.pop("tie_word_embeddings")
    c = Qwen3VLMoeConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.mrope_section == (24, 20, 20)
    assert not c.tie_word_embeddings


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda d: d["text_config"]["rope_parameters"].update(mrope_interleaved=False),
            "interleaved",
        ),
        (lambda d: d["vision_config"].update(out_hidden_size=48), "out_hidden_size"),
        (lambda d: d["vision_config"].update(deepstack_visual_indexes=[0, 3]), r"\[3\] out of"),
        (lambda d: d["vision_config"].update(num_position_embeddings=15), "perfect square"),
        (lambda d: d["vision_config"].update(hidden_act="relu"), "hidden_act"),
        (lambda d: d.pop("vision_config"), "vision_config: missing"),
        (lambda d: d.update(image_token_id=4000), "outside the vocabulary"),
    ],
)
def test_bad_values_raise_naming_the_key(edit, match):
    d = hf_vl_config().to_dict()
    edit(d)
    with pytest.raises(ModelConfigError, match=match):
        Qwen3VLMoeConfig.from_hf_dict(d)

"""The ViT's share of the train-step memory estimate (Qwen3-VL: patches per row)."""

from __future__ import annotations

import dataclasses

import pytest

from osworld_jax.model import ModelRuntimeConfig
from osworld_jax.trainer import TrainerConfig
from osworld_jax.trainer.memory import GiB, check_step_fits, estimate_step_memory, vision_bytes
from osworld_jax.trainer.state import TrainerError
from tests.model.vl_helpers import ours_config

# Qwen3-VL-30B-A3B's tower on a small LM: the published ViT widths, bench-vl's 4 screenshots.
VL = ours_config(
    vision={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
            "patch_size": 16, "deepstack_visual_indexes": [8, 16, 24]},
    text={"num_hidden_layers": 27},
)  # fmt: skip
PATCHES = 4 * 8160
RT = ModelRuntimeConfig(dtype="bfloat16", remat="none", attention="cudnn")


def test_no_images_no_vision_term():
    cfg = TrainerConfig()
    assert estimate_step_memory(VL, RT, cfg, rows=1, seq=16384).vision == 0.0
    assert vision_bytes(VL, RT, rows=1, patches=0) == 0.0


def test_remat_policies_order_and_per_patch_bytes():
    v = VL.vision
    by = {
        r: vision_bytes(VL, dataclasses.replace(RT, vision_remat=r), 1, PATCHES)
        for r in ("none", "dots", "full")
    }
    assert by["none"] > by["dots"] > by["full"] > 0
    # remat none, per patch and block: bf16 x (11 Hv + 2 I), the f32 upcasts XLA keeps
    # (8 Hv + 2 I) and the f32 softmax stats per head.
    hv, i = v.hidden_size, v.intermediate_size
    block = 2 * (11 * hv + 2 * i) + 4 * (8 * hv + 2 * i) + 4 * v.num_heads
    assert by["none"] >= PATCHES * v.depth * block
    # XLA's temp for this tower's gradient on an H200 was 96.7 GiB (benchmarks/NOTES.md).
    assert 0.95 * 96.7 * GiB < by["none"] < 1.1 * 96.7 * GiB
    # vision_remat falls back to remat; rows scale it.
    assert vision_bytes(VL, dataclasses.replace(RT, remat="full"), 1, PATCHES) == by["full"]
    assert vision_bytes(VL, RT, 2, PATCHES) == 2 * by["none"]


def test_xla_attention_adds_its_score_blocks():
    # The XLA path keeps f32 [heads, chunk, N] blocks (3 live: scores, probabilities, grads).
    def at(chunk: int) -> float:
        xla = dataclasses.replace(RT, attention="xla", vision_attention_chunk=chunk)
        return vision_bytes(VL, xla, 1, PATCHES)

    assert at(1024) - at(512) == pytest.approx(3 * 4 * 16 * 512 * PATCHES)


def test_a_tower_that_does_not_fit_names_vision_remat():
    cfg = TrainerConfig(master_dtype=None)
    plain = estimate_step_memory(VL, RT, cfg, rows=1, seq=16384)
    with_images = estimate_step_memory(VL, RT, cfg, rows=1, seq=16384, patches=PATCHES)
    capacity = plain.total + with_images.vision / 2  # room for the full-remat tower only
    with pytest.raises(TrainerError, match="vision_remat='full'"):
        check_step_fits(VL, RT, cfg, rows=1, seq=16384, patches=PATCHES, capacity=capacity)

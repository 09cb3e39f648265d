"""Shared pieces of the Qwen3-VL-MoE tests: a tiny transformers reference model and prompts.

The tiny model: 3 LM layers (layer 1 dense), 8 experts top-2, interleaved M-RoPE sections
(2, 1, 1) of head_dim 8; a 3-block ViT (patch 4, merge 2, a 4 x 4 position table) with DeepStack
after blocks 0 and 2. Fused expert tensors are not square (H = 32, I = 12).
"""

from __future__ import annotations

import numpy as np

from osworld_jax.model import ImageProcessor, Qwen3VLMoeConfig

IMG, VIDEO, START, END = 120, 121, 122, 123
VOCAB = 128

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    max_position_embeddings=512,
    initializer_range=0.1,
)
VISION = dict(
    depth=3,
    hidden_size=16,
    intermediate_size=24,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
    initializer_range=0.1,
)
# Patch 4, merge 2: sides are multiples of 8, 64 .. 48^2 pixels.
PROCESSOR = ImageProcessor(
    patch_size=4,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=64,
    max_pixels=48 * 48,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)


def hf_vl_config(text: dict | None = None, vision: dict | None = None, **top):
    """The transformers ``Qwen3VLMoeConfig`` of the tiny model."""
    from transformers import Qwen3VLMoeConfig as HFConfig

    return HFConfig(
        text_config={**TEXT, **(text or {})},
        vision_config={**VISION, **(vision or {})},
        image_token_id=IMG,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        **top,
    )


def ours_config(**kw) -> Qwen3VLMoeConfig:
    """Our `Qwen3VLMoeConfig` parsed from the transformers one."""
    cfg = Qwen3VLMoeConfig.from_hf_dict(hf_vl_config(**kw).to_dict())
    assert isinstance(cfg, Qwen3VLMoeConfig)
    return cfg


def build_hf_vl_model(path, seed: int = 0, **kw):
    """A random transformers Qwen3VLMoeForConditionalGeneration saved to ``path``.

    Norm weights are 1 + N(0, 0.2) and biases N(0, 0.1), so every parameter matters.
    """
    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(hf_vl_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def images(seed: int, sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """Random uint8 [H, W, 3] images of the given (H, W)."""
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def prompt(rng: np.random.RandomState, grids: np.ndarray, text: tuple[int, int] = (5, 3)):
    """Token ids: text, then per image <|vision_start|> pads <|vision_end|> text."""
    ids = list(rng.randint(0, 100, text[0]))
    for g in grids:
        ids += [START] + [IMG] * int(np.prod(g) // 4) + [END] + list(rng.randint(0, 100, text[1]))
    return ids


def hf_logits(model, ids: np.ndarray, pixel_values=None, grid=None):
    """(logits f32[B, S, V], router logits per MoE layer [B S, E]) of the torch model."""
    import torch

    kw = {}
    if pixel_values is not None:
        kw = dict(
            pixel_values=torch.as_tensor(pixel_values),
            image_grid_thw=torch.as_tensor(grid),
            mm_token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
        )
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), output_router_logits=True, **kw)
    return out.logits.float().numpy(), [r.float().numpy() for r in out.router_logits]

"""The Qwen3-VL-MoE architecture config (HF ``model_type == "qwen3_vl_moe"``). Numpy-free, jax-free.

A Qwen3-VL-MoE checkpoint is a Qwen3-MoE language model (``text_config``) plus a ViT
(``vision_config``) whose merged patch features replace the ``<|image_pad|>`` token embeddings
and whose DeepStack features are added to the first LM layers' outputs. `Qwen3VLMoeConfig`
therefore *is* a `Qwen3MoeConfig` (every text field, so the LM code, the trainer and the server
read it unchanged) with the vision tower, the vision token ids and the M-RoPE sections added.

Facts from transformers' ``Qwen3VLMoe*`` (5.x) that shape the parsing:
- the router always renormalises its top-k weights (HF's ``Qwen3VLMoeTextTopKRouter`` ignores
  ``norm_topk_prob``), so ``norm_topk_prob`` is always True here;
- the text rope is always the *interleaved* M-RoPE (``mrope_interleaved`` is not read by HF);
  an explicit ``mrope_interleaved: false`` is rejected because SGLang would honour it;
- a missing text ``rope_theta`` defaults to 500000 (HF's ``default_theta``), a missing
  ``mrope_section`` to [24, 20, 20];
- ``tie_word_embeddings`` is the top-level key (default False); the text config's copy is not read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from osworld_jax.model.config import Qwen3MoeConfig, register_model_type
from osworld_jax.model.errors import ModelConfigError

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")

# transformers' Qwen3VLMoeVisionConfig defaults, for keys a config.json may leave out.
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": (8, 16, 24),
    "initializer_range": 0.02,
}
# transformers' Qwen3VLMoeTextConfig defaults that differ from the Qwen3-MoE ones.
_TEXT_DEFAULTS: dict[str, Any] = {
    "rope_theta": 500000.0,
    "max_position_embeddings": 128000,
}
_TOP_DEFAULTS: dict[str, Any] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The Qwen3-VL vision tower (HF ``vision_config``).

    Attributes:
      depth: number of ViT blocks.
      hidden_size: ViT width Hv.
      hidden_act: activation of the block MLPs ("gelu_pytorch_tanh" or "gelu"); the mergers
        always use the exact (erf) GELU, as HF does.
      intermediate_size: width of the block MLPs.
      num_heads: attention heads (head dim ``hidden_size // num_heads``, a multiple of 4 so the
        2-D rotary splits it into row and column halves).
      in_channels: image channels C (3).
      patch_size: spatial patch side P in pixels.
      spatial_merge_size: m; each m x m block of patches becomes one LM token.
      temporal_patch_size: frames per temporal patch T (an image repeats over it).
      out_hidden_size: width of the merged features (= the LM hidden size).
      num_position_embeddings: rows of the learned position table (a perfect square, side^2),
        bilinearly resampled to each image's patch grid.
      deepstack_visual_indexes: ViT blocks whose outputs feed the DeepStack mergers; merger k's
        features are added to the output of LM layer k.
      initializer_range: std of the normal random init.
      rope_theta: base of the 2-D vision rotary embedding.
    """

    depth: int
    hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int
    num_heads: int
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...] = ()
    initializer_range: float = 0.02
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ModelConfigError(f"vision_config.{key}: {msg}")

        for key in (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "in_channels",
            "patch_size",
            "spatial_merge_size",
            "temporal_patch_size",
            "out_hidden_size",
            "num_position_embeddings",
        ):
            value = getattr(self, key)
            need(
                isinstance(value, int) and value > 0, key, f"must be a positive int, got {value!r}"
            )
        need(
            self.hidden_act in VISION_ACTIVATIONS,
            "hidden_act",
            f"{self.hidden_act!r} unsupported; supported: {VISION_ACTIVATIONS}",
        )
        need(
            self.hidden_size % self.num_heads == 0,
            "num_heads",
            f"{self.num_heads} must divide hidden_size {self.hidden_size}",
        )
        need(
            self.head_dim % 4 == 0,
            "num_heads",
            f"head dim {self.head_dim} must be a multiple of 4 (2-D rotary)",
        )
        side = math.isqrt(self.num_position_embeddings)
        need(
            side * side == self.num_position_embeddings,
            "num_position_embeddings",
            f"{self.num_position_embeddings} is not a perfect square",
        )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        need(not bad, "deepstack_visual_indexes", f"{bad} out of [0, {self.depth})")
        need(
            len(set(self.deepstack_visual_indexes)) == len(self.deepstack_visual_indexes),
            "deepstack_visual_indexes",
            f"duplicates in {list(self.deepstack_visual_indexes)}",
        )

    @property
    def head_dim(self) -> int:
        """Per-head width of the ViT attention."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: ``in_channels * temporal_patch_size * patch_size^2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_size(self) -> int:
        """Width of an m x m block of patch features: ``hidden_size * m^2``."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> VisionConfig:
        """Reads a HF ``vision_config`` dict (missing keys take transformers' defaults)."""
        vals = {k: d.get(k, v) for k, v in _VISION_DEFAULTS.items()}
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(vals[key], int):
                raise ModelConfigError(f"vision_config.{key}: {vals[key]!r} must be an int")
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ModelConfigError(f"vision_config.rope_parameters: not a dict: {rope!r}")
        if rope.get("rope_type", "axial") != "axial":
            raise ModelConfigError(
                f"vision_config.rope_parameters.rope_type: {rope['rope_type']!r}; only 'axial'"
            )
        vals["deepstack_visual_indexes"] = tuple(int(i) for i in vals["deepstack_visual_indexes"])
        return cls(**vals, rope_theta=float(rope.get("rope_theta", 10000.0)))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``vision_config`` dict (model_type as in the published Qwen3-VL-MoE files)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("rope_theta")
        d["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        d["model_type"] = "qwen3_vl_moe"
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3VLMoeConfig(Qwen3MoeConfig):
    """Qwen3-VL-MoE: the Qwen3-MoE text fields (inherited) plus the vision tower.

    Attributes:
      vision: the `VisionConfig`.
      image_token_id: id of ``<|image_pad|>`` (one per merged image token).
      video_token_id: id of ``<|video_pad|>`` (videos are not supported as model input).
      vision_start_token_id: id of ``<|vision_start|>``.
      vision_end_token_id: id of ``<|vision_end|>``.
      mrope_section: (t, h, w) frequency counts of the interleaved M-RoPE: frequency ``i`` of
        the ``head_dim / 2`` rotates by the h position if ``i % 3 == 1 and i < 3 h``, by the w
        position if ``i % 3 == 2 and i < 3 w``, else by the t position (HF's recomposition).
      mrope_interleaved: always True (HF's Qwen3-VL only implements the interleaved layout).
    """

    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    mrope_interleaved: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.norm_topk_prob:
            raise ModelConfigError(
                "Qwen3VLMoeConfig.norm_topk_prob: the Qwen3-VL-MoE router always renormalises"
            )
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ModelConfigError(
                f"text_config.rope_scaling.mrope_section: {list(self.mrope_section)} must be "
                "three non-negative ints"
            )
        if not self.mrope_interleaved:
            raise ModelConfigError(
                "text_config.rope_scaling.mrope_interleaved: false is unsupported (Qwen3-VL "
                "uses the interleaved M-RoPE)"
            )
        if self.vision.out_hidden_size != self.hidden_size:
            raise ModelConfigError(
                f"vision_config.out_hidden_size: {self.vision.out_hidden_size} != text "
                f"hidden_size {self.hidden_size}"
            )
        levels = len(self.vision.deepstack_visual_indexes)
        if levels > self.num_hidden_layers:
            raise ModelConfigError(
                f"vision_config.deepstack_visual_indexes: {levels} DeepStack levels > "
                f"{self.num_hidden_layers} LM layers"
            )
        ids = (self.image_token_id, self.vision_start_token_id, self.vision_end_token_id)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ModelConfigError(f"config.json: vision token ids {bad} outside the vocabulary")

    @property
    def mrope_axes(self) -> tuple[int, ...]:
        """Which position row (0 = t, 1 = h, 2 = w) rotates each of the ``head_dim / 2`` pairs."""
        _, h, w = self.mrope_section
        axes = []
        for i in range(self.head_dim // 2):
            if i % 3 == 1 and i < 3 * h:
                axes.append(1)
            elif i % 3 == 2 and i < 3 * w:
                axes.append(2)
            else:
                axes.append(0)
        return tuple(axes)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3VLMoeConfig:
        """Reads a HF Qwen3-VL-MoE ``config.json`` dict (``text_config`` + ``vision_config``)."""
        d = dict(d)
        if d.get("model_type") != "qwen3_vl_moe":
            raise ModelConfigError(
                f"config.json model_type: {d.get('model_type')!r} is not 'qwen3_vl_moe'"
            )
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), Mapping):
                raise ModelConfigError(f"config.json {key}: missing or not a dict")
        text = dict(d["text_config"])
        mrope = _pop_mrope(text)
        for key, value in _TEXT_DEFAULTS.items():
            if key == "rope_theta" and (text.get("rope_parameters") or {}).get("rope_theta"):
                continue
            text.setdefault(key, value)
        text["model_type"] = "qwen3_moe"
        text["norm_topk_prob"] = True  # HF's Qwen3-VL-MoE router always renormalises
        text["tie_word_embeddings"] = d.get("tie_word_embeddings", False)
        try:
            base = Qwen3MoeConfig.from_hf_dict(text)
            vision = VisionConfig.from_hf_dict(d["vision_config"])
        except ModelConfigError as e:
            raise ModelConfigError(
                str(e).replace("config.json", "config.json text_config")
            ) from None
        top = {k: d.get(k, v) for k, v in _TOP_DEFAULTS.items()}
        top.pop("tie_word_embeddings")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Qwen3MoeConfig)}
        return cls(**fields, vision=vision, **top, **mrope)

    def to_hf_dict(self, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The nested HF ``config.json`` dict that transformers and SGLang load."""
        text = super().to_hf_dict(torch_dtype=torch_dtype)
        for key in ("architectures", "torch_dtype", "use_sliding_window", "sliding_window"):
            text.pop(key)
        text.pop("max_window_layers")
        text["model_type"] = "qwen3_vl_moe_text"
        mrope = {"mrope_section": list(self.mrope_section), "mrope_interleaved": True}
        text["rope_scaling"] = {"rope_type": "default", **(text["rope_scaling"] or {}), **mrope}
        text["rope_parameters"] = {**text["rope_parameters"], **mrope}
        return {
            "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "model_type": "qwen3_vl_moe",
            "text_config": text,
            "vision_config": self.vision.to_hf_dict(),
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
        }


def _pop_mrope(text: dict[str, Any]) -> dict[str, Any]:
    """Takes the M-RoPE keys out of the text config's rope dicts (they are not a scaling type)."""
    found: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        raw = text.get(key)
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            raise ModelConfigError(f"config.json text_config {key}: not a dict: {raw!r}")
        rope = dict(raw)
        for k in _MROPE_KEYS:
            if k in rope:
                found[k] = rope.pop(k)
        for k in ("type", "rope_type"):
            if rope.get(k) == "mrope":  # Qwen2-VL's legacy name of the default rope + sections
                rope[k] = "default"
        text[key] = rope
    out: dict[str, Any] = {}
    if "mrope_section" in found:
        section = found["mrope_section"]
        if not isinstance(section, list | tuple) or not all(isinstance(s, int) for s in section):
            raise ModelConfigError(
                f"config.json text_config rope_scaling.mrope_section: {section!r} is not a list "
                "of ints"
            )
        out["mrope_section"] = tuple(section)
    if "mrope_interleaved" in found:
        out["mrope_interleaved"] = bool(found["mrope_interleaved"])
    return out


register_model_type("qwen3_vl_moe", Qwen3VLMoeConfig)

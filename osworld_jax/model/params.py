"""The parameter table: one source of truth for every parameter's path, shape and logical axes.

Layer parameters are stacked along a leading ``layers`` axis, per kind: ``attn.*`` over all L
layers, ``moe.*`` over the MoE layers and ``mlp.*`` over the dense-MLP layers (in layer order).
Matmul weights are stored ``[in, out]`` (HF stores ``[out, in]``; see `hf_io`).

A `Qwen3VLMoeConfig` adds the vision tower: ``vision.*`` (patch embedding, position table,
final merger; unstacked), ``vision_blocks.*`` stacked over the ViT blocks and ``deepstack.*``
stacked over the DeepStack mergers.
"""

from __future__ import annotations

import dataclasses
import math

from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.vl_config import Qwen3VLMoeConfig, VisionConfig

# Logical axis names used below (mapped onto mesh axes by `sharding.ShardingRules`).
LOGICAL_AXES = (
    "layers",
    "vocab",
    "embed",
    "q_heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "experts",
    "expert_mlp",
    "norm",
    "router_experts",
    "vision_embed",
    "vision_heads",
    "vision_mlp",
)
# Parameter groups holding one array per name (every other group is stacked over layers).
UNSTACKED_GROUPS = ("top", "vision")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter.

    Attributes:
      shape: array shape.
      axes: one logical axis name (or None) per dimension.
      init: "normal" (std ``std``), "ones" or "zeros".
      std: std of the "normal" init (None: the text config's initializer_range).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    std: float | None = None


def param_specs(config: Qwen3MoeConfig) -> dict[str, ParamSpec]:
    """``{"group.name": ParamSpec}`` for ``config`` (groups: top, attn, moe, mlp)."""
    c = config
    L, H, V = c.num_hidden_layers, c.hidden_size, c.vocab_size
    N, KV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Lm, Ld = len(c.moe_layers), len(c.dense_layers)
    E, Im, F = c.num_experts, c.moe_intermediate_size, c.intermediate_size
    specs = {
        "top.embed": ParamSpec(shape=(V, H), axes=("vocab", "embed")),
        "top.final_norm": ParamSpec(shape=(H,), axes=("norm",), init="ones"),
        "attn.input_norm": ParamSpec(shape=(L, H), axes=("layers", "norm"), init="ones"),
        "attn.q_proj": ParamSpec(shape=(L, H, N, D), axes=("layers", "embed", "q_heads", None)),
        "attn.k_proj": ParamSpec(shape=(L, H, KV, D), axes=("layers", "embed", "kv_heads", None)),
        "attn.v_proj": ParamSpec(shape=(L, H, KV, D), axes=("layers", "embed", "kv_heads", None)),
        "attn.o_proj": ParamSpec(shape=(L, N, D, H), axes=("layers", "q_heads", None, "embed")),
        "attn.q_norm": ParamSpec(shape=(L, D), axes=("layers", "head_dim"), init="ones"),
        "attn.k_norm": ParamSpec(shape=(L, D), axes=("layers", "head_dim"), init="ones"),
        "attn.post_norm": ParamSpec(shape=(L, H), axes=("layers", "norm"), init="ones"),
    }
    if not c.tie_word_embeddings:
        specs["top.lm_head"] = ParamSpec(shape=(H, V), axes=("embed", "vocab"))
    if Lm:
        e_in = ("layers", "experts", "embed", "expert_mlp")
        specs |= {
            "moe.router": ParamSpec(shape=(Lm, H, E), axes=("layers", "embed", "router_experts")),
            "moe.gate": ParamSpec(shape=(Lm, E, H, Im), axes=e_in),
            "moe.up": ParamSpec(shape=(Lm, E, H, Im), axes=e_in),
            "moe.down": ParamSpec(
                shape=(Lm, E, Im, H), axes=("layers", "experts", "expert_mlp", "embed")
            ),
        }
    if Ld:
        specs |= {
            "mlp.gate": ParamSpec(shape=(Ld, H, F), axes=("layers", "embed", "mlp")),
            "mlp.up": ParamSpec(shape=(Ld, H, F), axes=("layers", "embed", "mlp")),
            "mlp.down": ParamSpec(shape=(Ld, F, H), axes=("layers", "mlp", "embed")),
        }
    if isinstance(c, Qwen3VLMoeConfig):
        specs |= vision_param_specs(c.vision)
    return specs


def vision_param_specs(v: VisionConfig) -> dict[str, ParamSpec]:
    """The ViT's parameters (see module docstring); biases and norms start at 0 / 1 as in HF."""
    Lv, Hv, Iv, Nh, Dh = v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    Hm, Ho, Nd = v.merged_size, v.out_hidden_size, len(v.deepstack_visual_indexes)
    std = v.initializer_range

    def w(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> ParamSpec:
        return ParamSpec(shape=shape, axes=axes, std=std)

    def const(shape: tuple[int, ...], axes: tuple[str | None, ...], init: str) -> ParamSpec:
        return ParamSpec(shape=shape, axes=axes, init=init)

    specs = {
        "vision.patch_embed": w((v.patch_dim, Hv), (None, "vision_embed")),
        "vision.patch_bias": const((Hv,), ("norm",), "zeros"),
        "vision.pos_embed": w((v.num_position_embeddings, Hv), (None, "vision_embed")),
        "vision.merger_norm": const((Hv,), ("norm",), "ones"),
        "vision.merger_norm_bias": const((Hv,), ("norm",), "zeros"),
        "vision.merger_fc1": w((Hm, Hm), ("vision_embed", "vision_mlp")),
        "vision.merger_fc1_bias": const((Hm,), ("vision_mlp",), "zeros"),
        "vision.merger_fc2": w((Hm, Ho), ("vision_mlp", "embed")),
        "vision.merger_fc2_bias": const((Ho,), ("norm",), "zeros"),
        "vision_blocks.norm1": const((Lv, Hv), ("layers", "norm"), "ones"),
        "vision_blocks.norm1_bias": const((Lv, Hv), ("layers", "norm"), "zeros"),
        "vision_blocks.qkv": w(
            (Lv, Hv, 3, Nh, Dh), ("layers", "vision_embed", None, "vision_heads", None)
        ),
        "vision_blocks.qkv_bias": const(
            (Lv, 3, Nh, Dh), ("layers", None, "vision_heads", None), "zeros"
        ),
        "vision_blocks.proj": w((Lv, Nh, Dh, Hv), ("layers", "vision_heads", None, "vision_embed")),
        "vision_blocks.proj_bias": const((Lv, Hv), ("layers", "norm"), "zeros"),
        "vision_blocks.norm2": const((Lv, Hv), ("layers", "norm"), "ones"),
        "vision_blocks.norm2_bias": const((Lv, Hv), ("layers", "norm"), "zeros"),
        "vision_blocks.fc1": w((Lv, Hv, Iv), ("layers", "vision_embed", "vision_mlp")),
        "vision_blocks.fc1_bias": const((Lv, Iv), ("layers", "vision_mlp"), "zeros"),
        "vision_blocks.fc2": w((Lv, Iv, Hv), ("layers", "vision_mlp", "vision_embed")),
        "vision_blocks.fc2_bias": const((Lv, Hv), ("layers", "norm"), "zeros"),
    }
    if Nd:
        specs |= {
            "deepstack.norm": const((Nd, Hm), ("layers", "norm"), "ones"),
            "deepstack.norm_bias": const((Nd, Hm), ("layers", "norm"), "zeros"),
            "deepstack.fc1": w((Nd, Hm, Hm), ("layers", "vision_embed", "vision_mlp")),
            "deepstack.fc1_bias": const((Nd, Hm), ("layers", "vision_mlp"), "zeros"),
            "deepstack.fc2": w((Nd, Hm, Ho), ("layers", "vision_mlp", "embed")),
            "deepstack.fc2_bias": const((Nd, Ho), ("layers", "norm"), "zeros"),
        }
    return specs


def layer_runs(config: Qwen3MoeConfig) -> list[tuple[bool, int, int, int]]:
    """Maximal runs of consecutive layers of one kind: ``(is_moe, start, end, kind_start)``.

    ``kind_start`` indexes the run's first layer in its kind's stack (``moe.*`` or ``mlp.*``).
    """
    runs: list[tuple[bool, int, int, int]] = []
    seen = {True: 0, False: 0}
    for i in range(config.num_hidden_layers):
        kind = config.is_moe_layer(i)
        if runs and runs[-1][0] == kind:
            k, s, _, ks = runs[-1]
            runs[-1] = (k, s, i + 1, ks)
        else:
            runs.append((kind, i, i + 1, seen[kind]))
        seen[kind] += 1
    return runs


def param_counts(config: Qwen3MoeConfig) -> dict[str, int]:
    """Parameter counts of ``config``: every array of `param_specs`, and those a token uses.

    ``active`` counts what one text token's forward pass reads: everything except the experts
    it is not routed to (``E - K`` of each MoE layer's experts) and the vision tower.

    Returns:
      {"total", "vision" (ViT + mergers), "language" (total - vision), "experts" (all routed
      experts), "active" (language - (E - K) / E of the experts)}.
    """
    total = vision = experts = 0
    for key, spec in param_specs(config).items():
        n = math.prod(spec.shape)
        total += n
        group, name = key.split(".")
        if group in ("vision", "vision_blocks", "deepstack"):
            vision += n
        elif group == "moe" and name in ("gate", "up", "down"):
            experts += n
    e, k = config.num_experts, config.num_experts_per_tok
    language = total - vision
    return {
        "total": total,
        "vision": vision,
        "language": language,
        "experts": experts,
        "active": language - experts * (e - k) // e,
    }


def decay_mask(config: Qwen3MoeConfig) -> dict[str, dict[str, bool]]:
    """Which parameters get weight decay: the normal-initialised matrices and embeddings.

    Norm scales and biases (init "ones" / "zeros") are vectors even when stacked over layers
    (``[L, H]``, ``[Lv, 3, heads, head_dim]``), so a rule on ``ndim`` alone would decay them.
    Returns ``{group: {name: bool}}`` shaped like `Policy.params()`.
    """
    out: dict[str, dict[str, bool]] = {}
    for key, spec in param_specs(config).items():
        group, name = key.split(".")
        out.setdefault(group, {})[name] = spec.init == "normal"
    return out

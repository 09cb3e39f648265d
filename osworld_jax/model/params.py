"""The parameter table: one source of truth for every parameter's path, shape and logical axes.

Layer parameters are stacked along a leading ``layers`` axis, per kind: ``attn.*`` over all L
layers, ``moe.*`` over the MoE layers and ``mlp.*`` over the dense-MLP layers (in layer order).
Matmul weights are stored ``[in, out]`` (HF stores ``[out, in]``; see `hf_io`).
"""

from __future__ import annotations

import dataclasses

from osworld_jax.model.config import Qwen3MoeConfig

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
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter.

    Attributes:
      shape: array shape.
      axes: one logical axis name (or None) per dimension.
      init: "normal" (std = initializer_range) or "ones".
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"


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

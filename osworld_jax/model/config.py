"""Model configs: the HF Qwen3-MoE architecture config and our runtime (how to compute) config.

`Qwen3MoeConfig` mirrors the keys of a HF ``config.json`` of ``model_type == "qwen3_moe"``
(transformers' `Qwen3MoeConfig`). It reads both the legacy layout (``rope_theta`` +
``rope_scaling``, ``num_experts``) and the transformers 5.x layout (``rope_parameters``,
``num_local_experts``); `to_hf_dict` writes both so that transformers 4.x/5.x and SGLang load it.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from osworld_jax.model.errors import ModelConfigError

# RoPE scaling types we implement exactly as transformers does (see rope.py). "dynamic" NTK is
# left out on purpose: HF recomputes its frequencies from the longest sequence of each call and
# caches them across calls, so a token's embedding would depend on what it is batched with.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

# HF defaults (transformers' Qwen3MoeConfig) for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, Any] = {
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "router_aux_loss_coef": 0.001,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
    "initializer_range": 0.02,
}
#: ``model_type`` -> the `Qwen3MoeConfig` subclass that reads such a ``config.json`` (filled by
#: `register_model_type` when the subclass's module is imported: ``vl_config`` for
#: ``qwen3_vl_moe``).
MODEL_TYPES: dict[str, type[Qwen3MoeConfig]] = {}


def register_model_type(model_type: str, cls: type[Qwen3MoeConfig]) -> None:
    """Makes `Qwen3MoeConfig.from_hf_dict` read a ``config.json`` of ``model_type`` as ``cls``."""
    MODEL_TYPES[model_type] = cls


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts_per_tok",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig:
    """The Qwen3-MoE architecture (the keys of HF ``config.json``).

    Attributes:
      vocab_size: rows of the embedding / columns of the lm head.
      hidden_size: model width H.
      intermediate_size: width of the dense SwiGLU MLP (layers in ``mlp_only_layers``).
      moe_intermediate_size: width I of each expert's SwiGLU MLP.
      num_hidden_layers: number of decoder layers L.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads (GQA); divides ``num_attention_heads``.
      head_dim: per-head width D (HF default: hidden_size // num_attention_heads).
      num_experts: experts per MoE layer E.
      num_experts_per_tok: experts per token K (top-k).
      norm_topk_prob: renormalise the K gate weights to sum to 1.
      decoder_sparse_step: layer i is MoE iff (i + 1) % step == 0 (and not in mlp_only_layers).
      mlp_only_layers: layer indices that keep a dense SwiGLU MLP.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_scaling: None, or the sorted (key, value) items of the HF rope scaling dict (always
        with a ``rope_type`` key in `SUPPORTED_ROPE_TYPES`); a tuple so the config stays hashable.
      tie_word_embeddings: lm head = embedding transposed.
      max_position_embeddings: the context length the model was configured for.
      router_aux_loss_coef: HF's load-balancing loss coefficient (informational; the runtime
        config's coefficient is the one the trainer applies).
      eos_token_id: end-of-sequence id(s).
      bos_token_id: begin-of-sequence id, if any.
      pad_token_id: padding id, if any.
      initializer_range: std of the normal random init.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    router_aux_loss_coef: float = 0.001
    eos_token_id: int | tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ModelConfigError(f"Qwen3MoeConfig.{key}: {msg}")

        for key in _REQUIRED + ("head_dim", "num_experts"):
            need(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"{self.num_key_value_heads} must divide num_attention_heads "
            f"{self.num_attention_heads}",
        )
        need(
            self.num_experts_per_tok <= self.num_experts,
            "num_experts_per_tok",
            f"{self.num_experts_per_tok} > num_experts {self.num_experts}",
        )
        need(self.decoder_sparse_step >= 1, "decoder_sparse_step", "must be >= 1")
        need(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        need(not bad, "mlp_only_layers", f"indices {bad} out of [0, {self.num_hidden_layers})")
        if self.rope_scaling is not None:
            rope_type = dict(self.rope_scaling).get("rope_type")
            need(
                rope_type in SUPPORTED_ROPE_TYPES,
                "rope_scaling",
                f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}",
            )

    # ---- derived ---------------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        """HF's rule: MoE iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Indices of the dense-MLP layers, in order."""
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """`rope_scaling` as a plain dict (or None)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **changes: Any) -> Qwen3MoeConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- HF dict I/O -----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3MoeConfig:
        """Reads a HF ``config.json`` dict; unsupported values raise `ModelConfigError`.

        A ``qwen3_vl_moe`` dict gives a `Qwen3VLMoeConfig` (a subclass: its text fields are
        these), so code that reads a checkpoint's config keeps working on VL checkpoints. The
        subclasses register their model type in `MODEL_TYPES` (`register_model_type`) when
        their module is imported (``osworld_jax.model`` imports ``vl_config``), so this module
        imports none of them.
        """
        d = dict(d)
        model_type = d.get("model_type", "qwen3_moe")
        if model_type in MODEL_TYPES and cls is Qwen3MoeConfig:
            return MODEL_TYPES[model_type].from_hf_dict(d)
        if model_type != "qwen3_moe":
            known = ", ".join(repr(t) for t in ("qwen3_moe", *MODEL_TYPES))
            raise ModelConfigError(f"config.json model_type: {model_type!r} is not one of {known}")
        for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
            if key in d and d[key] != want:
                raise ModelConfigError(f"config.json {key}: {d[key]!r} unsupported (need {want!r})")
        if d.get("use_sliding_window"):
            raise ModelConfigError("config.json use_sliding_window: sliding window unsupported")
        missing = [k for k in _REQUIRED if k not in d]
        num_experts = d.get("num_experts", d.get("num_local_experts"))
        if num_experts is None:
            missing.append("num_experts")
        if missing:
            raise ModelConfigError(f"config.json: missing required keys {missing}")
        vals = {k: d.get(k, v) for k, v in _HF_DEFAULTS.items()}
        vals["mlp_only_layers"] = vals["mlp_only_layers"] or []
        rope_theta, rope_scaling = _parse_rope(d)
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        eos = vals["eos_token_id"]
        return cls(
            **{k: int(d[k]) for k in _REQUIRED},
            head_dim=int(head_dim),
            num_experts=int(num_experts),  # type: ignore[arg-type]
            norm_topk_prob=bool(vals["norm_topk_prob"]),
            decoder_sparse_step=int(vals["decoder_sparse_step"]),
            mlp_only_layers=tuple(int(i) for i in vals["mlp_only_layers"]),
            rms_norm_eps=float(vals["rms_norm_eps"]),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(vals["tie_word_embeddings"]),
            max_position_embeddings=int(vals["max_position_embeddings"]),
            router_aux_loss_coef=float(vals["router_aux_loss_coef"]),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            bos_token_id=vals["bos_token_id"],
            pad_token_id=vals["pad_token_id"],
            initializer_range=float(vals["initializer_range"]),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen3MoeConfig:
        """Reads ``path`` (a ``config.json``, or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{path}: no such config file") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: invalid JSON ({e})") from None
        try:
            return cls.from_hf_dict(d)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from None

    def to_hf_dict(self, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A HF ``config.json`` dict (legacy rope keys plus 5.x ``rope_parameters``)."""
        scaling = self.rope_scaling_dict
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if scaling is not None:
            rope_parameters.update(scaling)
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "eos_token_id": eos,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "output_router_logits": False,
            "use_cache": True,
            "torch_dtype": torch_dtype,
        }


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, normalised rope_scaling items) from either HF layout."""
    params = d.get("rope_parameters")
    if params:
        if not isinstance(params, Mapping):
            raise ModelConfigError(f"config.json rope_parameters: not a dict: {params!r}")
        scaling = dict(params)
        theta = scaling.pop("rope_theta", d.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
    else:
        theta = d.get("rope_theta", _HF_DEFAULTS["rope_theta"])
        raw = d.get("rope_scaling")
        if raw is not None and not isinstance(raw, Mapping):
            raise ModelConfigError(f"config.json rope_scaling: not a dict: {raw!r}")
        scaling = dict(raw) if raw else {}
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling["type"])
        del scaling["type"]
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"config.json rope_scaling: rope type {rope_type!r} is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("yarn", "llama3"):
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if rope_type in ("linear", "llama3") and "factor" not in scaling:
        raise ModelConfigError(f"config.json rope_scaling: {rope_type} needs 'factor'")
    return float(theta), tuple(sorted(scaling.items()))


#: Parameter and compute dtypes of the policy.
ComputeDtype = Literal["float32", "bfloat16"]
#: Attention kernels: XLA's (any rows) or cuDNN's fused causal attention (one-segment rows).
Attention = Literal["xla", "cudnn"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRuntimeConfig:
    """How the policy computes (not what it computes).

    Precision policy: parameters and activations use ``dtype``; the router logits, softmax and
    top-k, every RMSNorm, the attention softmax, RoPE and the final logits run in float32.
    ``dtype="float32"`` is the exact mode the parity tests use.

    Attributes:
      expert_backend: "auto" (resolved per platform when traced, see
        `osworld_jax.model.moe.auto_expert_backend`: the Pallas grouped matmuls on GPU, "ragged"
        on TPU/CPU), "dense" (every expert on every token; the reference), "ragged" (sort by
        expert + ``jax.lax.ragged_dot``; CPU/TPU: on a GPU it is a dense masked matmul and warns
        once), "pallas_gmm" / "pallas_gmm_mosaic" (`osworld_jax.model.kernels`: Triton / Mosaic
        GPU grouped matmuls) or "tokamax" (``tokamax.ragged_dot``; imported lazily).
      dtype: parameter and compute dtype name, "float32" or "bfloat16".
      remat: rematerialisation policy per decoder layer: "none", "full" (save nothing),
        "dots" (save matmul outputs without batch dims) or "dots_with_batch" (save all matmuls).
      scan_layers: run consecutive layers of the same kind under ``jax.lax.scan`` (smaller HLO,
        faster compiles) instead of an unrolled Python loop; numerically identical.
      router_aux_loss_coef: weight of ``aux["load_balancing_loss"]`` in ``aux["total"]``.
      router_z_loss_coef: weight of ``aux["router_z_loss"]`` in ``aux["total"]``.
      attention: "xla" (the masked softmax of `layers.attention`; any packing) or "cudnn"
        (`kernels.attention.padded_causal_attention`: cuDNN flash attention on GPU, exact on real
        tokens of rows holding one segment then padding, the trainer's layout; XLA elsewhere).
      attention_chunk: query block size of the XLA attention (0: one block). Bounds the f32
        score buffer to [B, N, chunk, T] in forward and backward (blocks are rematerialised).
      activation_batch_axes: mesh axes the residual stream's batch dim is constrained to when the
        call runs under ``jax.set_mesh(mesh)`` (no-op without a mesh context or when they do not
        divide the batch); keeps GSPMD from resharding activations onto parameter axes.
      vision_attention_chunk: query block size of the ViT's XLA attention (0: one block).
        Bounds its f32 score buffer to [heads, chunk, N patches] (blocks are rematerialised);
        with ``attention="cudnn"`` on a GPU the ViT runs cuDNN's packed flash attention instead
        (`osworld_jax.model.vision.packed_attention`: per image, no score buffer).
      vision_remat: rematerialisation policy per ViT block (`remat`'s names); None: ``remat``.
      vision_attention: the ViT's attention kernel, "xla" or "cudnn" (cuDNN's packed flash
        attention per image on a GPU in 16-bit; XLA elsewhere); None: ``attention``. The
        embedded server sets it alone (its LM attends to a KV cache, which ``attention`` does
        not cover).
      expert_parallel: when the call runs under a mesh whose ``expert`` axis is > 1, send each
        token to the devices holding its experts and run the grouped GEMMs on local experts
        only (`osworld_jax.model.expert_parallel`: all-gather dispatch, reduce-scatter
        combine; dropless). False: every device gathers all experts' weights and runs its own
        tokens (the FSDP layout of the experts).
    """

    expert_backend: str = "auto"
    dtype: ComputeDtype = "float32"
    remat: str = "none"
    scan_layers: bool = False
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    activation_batch_axes: tuple[str, ...] = ("data", "fsdp", "expert")
    attention: Attention = "xla"
    attention_chunk: int = 0
    vision_attention_chunk: int = 1024
    vision_remat: str | None = None
    vision_attention: Attention | None = None
    expert_parallel: bool = True

    def __post_init__(self) -> None:
        from osworld_jax.model.moe import EXPERT_BACKENDS
        from osworld_jax.model.remat import REMAT_POLICIES

        try:
            EXPERT_BACKENDS.validate(self.expert_backend, "ModelRuntimeConfig.expert_backend")
            REMAT_POLICIES.validate(self.remat, "ModelRuntimeConfig.remat")
            if self.vision_remat is not None:
                REMAT_POLICIES.validate(self.vision_remat, "ModelRuntimeConfig.vision_remat")
        except Exception as e:
            raise ModelConfigError(str(e)) from None
        kernels = typing.get_args(Attention)
        for key, allowed in (("attention", kernels), ("vision_attention", (None, *kernels))):
            if getattr(self, key) not in allowed:
                raise ModelConfigError(
                    f"ModelRuntimeConfig.{key}: {getattr(self, key)!r}; choose 'xla' or 'cudnn'"
                )
        for key in ("attention_chunk", "vision_attention_chunk"):
            if getattr(self, key) < 0:
                raise ModelConfigError(
                    f"ModelRuntimeConfig.{key}: {getattr(self, key)} must be >= 0"
                )
        if self.dtype not in typing.get_args(ComputeDtype):
            raise ModelConfigError(
                f"ModelRuntimeConfig.dtype: {self.dtype!r}; choose 'float32' or 'bfloat16'"
            )

"""The Qwen3-MoE policy (Flax NNX): embed -> L decoder layers -> final norm -> lm head.

Same function as HF transformers' ``Qwen3MoeForCausalLM`` (see `layers`, `moe`, `rope`).

Precision policy: parameters and activations are ``runtime.dtype`` (bfloat16 in training,
float32 in the parity tests); router logits/softmax/top-k, RMSNorm, RoPE, the attention
softmax and the final logits are computed in float32.

Packed rows: ``segment_ids`` (0 = padding) and ``positions`` are inputs; attention stays inside
a segment and is causal by position. With a KV cache (the embedded server's decode path) the
call scatters its k/v at ``positions`` and each query attends cache slots ``j <= position``.

Qwen3-VL-MoE (a `Qwen3VLMoeConfig`): ``pixel_values`` + ``image_grid_thw`` run the vision tower
(`osworld_jax.model.vision`); its merged features replace the embeddings of the image tokens
(in order) and its DeepStack features are added to the outputs of LM layers ``0..D-1`` at those
tokens (HF ``Qwen3VLMoeModel``). ``positions`` may then be the M-RoPE i32[3, B, S] of
`mrope_positions`; attention stays causal by token order within a segment.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from osworld_jax.model import layers
from osworld_jax.model.config import ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.moe import load_balancing_loss
from osworld_jax.model.params import layer_runs, param_specs
from osworld_jax.model.remat import apply_remat
from osworld_jax.model.rope import mrope_cos_sin, rope_cos_sin, rope_frequencies
from osworld_jax.model.vision import gather_rows, scatter_rows, vision_tower
from osworld_jax.model.vl_config import Qwen3VLMoeConfig

Params = dict[str, dict[str, jax.Array]]


class KVCache(NamedTuple):
    """Per-layer key/value cache rows: k, v [L, B, max_len, num_kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array


def init_kv_cache(
    config: Qwen3MoeConfig, batch: int, max_len: int, dtype: Any = jnp.bfloat16
) -> KVCache:
    """An all-zero `KVCache` for ``batch`` rows of up to ``max_len`` tokens."""
    shape = (config.num_hidden_layers, batch, max_len, config.num_key_value_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class PolicyOutput(NamedTuple):
    """What a policy call returns.

    Attributes:
      logits: f32[B, S, V] (None when called with ``return_logits=False``).
      hidden: [B, S, H] final-normed hidden states (``logits = hidden @ unembed``).
      routed_experts: i32[B, S, L, K] experts used per token and layer (-1 on dense layers).
      aux: {"load_balancing_loss", "router_z_loss", "total", "agreeing_routes",
        "replayed_routes"} float32 scalars; ``total`` is ``router_aux_loss_coef * lb +
        router_z_loss_coef * z`` of the runtime config; with ``replay_experts``,
        ``replayed_routes`` counts the valid (token, MoE layer) pairs with a replayed route and
        ``agreeing_routes`` those whose replayed expert set equals the model's own top-k there
        (R3 route agreement = agreeing / replayed).
      kv_cache: the updated `KVCache` when one was passed, else None.
    """

    logits: jax.Array | None
    hidden: jax.Array
    routed_experts: jax.Array
    aux: dict[str, jax.Array]
    kv_cache: KVCache | None


def forward(
    params: Params,
    config: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    input_ids: Int[Array, "B S"],
    *,
    positions: Int[Array, "B S"] | Int[Array, "3 B S"] | None = None,
    segment_ids: Int[Array, "B S"] | None = None,
    replay_experts: Int[Array, "B S L K"] | None = None,
    kv_cache: KVCache | None = None,
    return_logits: bool = True,
    pixel_values: jax.Array | None = None,
    image_grid_thw: jax.Array | None = None,
    cache_positions: Int[Array, "B S"] | None = None,
    image_features: tuple[jax.Array, jax.Array] | None = None,
    cache_fresh: bool = False,
) -> PolicyOutput:
    """The policy as a pure function of its parameter tree (see `Policy.__call__`).

    ``kv_cache`` [L, B, M, KV, D] rides the layer loops' carry whole: each layer writes its
    rows at ``cache_positions`` in place and attends over its own window of it (no layer
    slices, stacks or concatenates the cache). ``cache_fresh`` (with ``kv_cache``, rows written
    from cache row 0: a prefill keeping no prefix): the queries attend to the call's own keys,
    row b's first ``sum(segment_ids[b])`` real (`osworld_jax.model.layers.own_causal_attention`:
    cuDNN's causal kernel on a GPU with ``runtime.attention="cudnn"``), not to the cache; the
    rows are written as usual.

    ``image_features`` stands in for ``pixel_values`` with the vision tower's outputs computed
    already (the server's image-embedding cache): ``(embeds [B, M, H], deepstack [B, D, M, H])``
    in `vision_tower`'s per-row layout, row b's image tokens first.
    """
    b, s = input_ids.shape
    # The mask is causal by token index when the order is the index itself: M-RoPE rows, or
    # positions left to their default (given 1-D positions may be in any order).
    by_index = positions is None or positions.ndim == 3
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    top = params["top"]
    x = jnp.take(_gathered_table(top["embed"]), input_ids, axis=0)  # [B, S, H]
    deep = None
    if pixel_values is not None or image_features is not None:
        x, deep = _merge_vision(
            params, config, runtime, input_ids, x, pixel_values, image_grid_thw, image_features
        )
    x = layers.constrain_batch(x, runtime.activation_batch_axes)
    inv_freq, attn_scale = rope_frequencies(config)
    if positions.ndim == 3:  # M-RoPE [3, B, S]; causal by token order
        if not isinstance(config, Qwen3VLMoeConfig):
            raise ValueError("positions i32[3, B, S] (M-RoPE) need a Qwen3VLMoeConfig")
        cos, sin = mrope_cos_sin(positions, inv_freq, attn_scale, config.mrope_axes)  # [B, S, D]
        order = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    else:
        cos, sin = rope_cos_sin(positions, inv_freq, attn_scale)  # [B, S, D]
        order = positions
    if cache_positions is None:
        if kv_cache is not None and positions.ndim == 3:
            raise ValueError("a KV cache with M-RoPE positions needs cache_positions i32[B, S]")
        cache_positions = order
    mask = None if kv_cache is not None else layers.segment_mask(segment_ids, order)
    valid = (segment_ids != 0).astype(jnp.float32)  # [B, S]
    common = dict(config=config, runtime=runtime, cos=cos, sin=sin, mask=mask, causal=by_index)
    common |= dict(positions=cache_positions, valid=valid)
    if cache_fresh:
        if kv_cache is None:
            raise ValueError("cache_fresh needs a kv_cache")
        common |= dict(own_lengths=jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32))
    num_deep = 0 if deep is None else deep.levels

    if replay_experts is not None:  # the batch's compact route type (int8 for 128 experts)
        replay_experts = replay_experts.astype(jnp.int32)
    routed, counts, prob_sums, z_sums = [], [], [], []
    agreeing, replayed = [], []
    cache = None if kv_cache is None else layers.LayerCache(kv_cache.k, kv_cache.v)
    for is_moe, start, end, kind_start in _split_runs(layer_runs(config), num_deep):
        n = end - start
        xs = {
            "attn": _slice(params["attn"], start, end),
            "mlp": _slice(params["moe" if is_moe else "mlp"], kind_start, kind_start + n),
            "replay": None
            if replay_experts is None
            else jnp.moveaxis(replay_experts[:, :, start:end], 2, 0),  # [n, B, S, K]
            "layer": jnp.arange(start, end, dtype=jnp.int32),  # the cache's layer index
        }

        def body(carry, xl, is_moe=is_moe):
            x, cache = carry  # cache: every layer's rows, written in place at xl["layer"]
            x, out = layers.decoder_layer(
                xl["attn"],
                xl["mlp"],
                x,
                is_moe=is_moe,
                replay=xl["replay"],
                cache=cache,
                layer=xl["layer"],
                **common,
            )
            return (x, out.cache), out._replace(cache=None)

        body = apply_remat(body, runtime.remat)
        if runtime.scan_layers:
            (x, cache), out = jax.lax.scan(body, (x, cache), xs)
        else:
            outs = []
            for i in range(n):
                (x, cache), o = body((x, cache), jax.tree.map(lambda a, i=i: a[i], xs))
                outs.append(o)
            out = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        if deep is not None and end - 1 < num_deep:  # DeepStack: after LM layer end - 1
            x = deep.add(x, end - 1)
        routed.append(out.routed)  # [n, B, S, K]
        counts.append(out.expert_count.sum(0))
        prob_sums.append(out.prob_sum.sum(0))
        z_sums.append(out.z_sum.sum())
        agreeing.append(out.agreeing_routes.sum())
        replayed.append(out.replayed_routes.sum())

    hidden = layers.rms_norm(x, top["final_norm"], config.rms_norm_eps)  # [B, S, H]
    logits = None
    if return_logits:
        logits = jnp.einsum(
            "bsh,hv->bsv",
            hidden,
            unembed_matrix(params, config),
            preferred_element_type=jnp.float32,
        )
    num_moe = len(config.moe_layers)
    rows = jnp.sum(valid) * num_moe
    lb = load_balancing_loss(sum(counts), sum(prob_sums), rows) if num_moe else jnp.zeros(())
    z = sum(z_sums) / jnp.maximum(rows, 1.0) if num_moe else jnp.zeros(())
    aux = {
        "load_balancing_loss": lb,
        "router_z_loss": z,
        "total": runtime.router_aux_loss_coef * lb + runtime.router_z_loss_coef * z,
        "agreeing_routes": sum(agreeing, jnp.zeros(())),
        "replayed_routes": sum(replayed, jnp.zeros(())),
    }
    routed_experts = jnp.moveaxis(jnp.concatenate(routed, axis=0), 0, 2)  # [B, S, L, K]
    new_cache = None if cache is None else KVCache(cache.k, cache.v)
    return PolicyOutput(logits, hidden, routed_experts, aux, new_cache)


def _gathered_table(embed: jax.Array) -> jax.Array:
    """The embedding table with its embed dim whole (gathered over ``fsdp``) under a mesh.

    Left to the partitioner, a lookup into a table split on its embed dim produced
    ``[B, S, H / fsdp]`` rows of the *whole* batch and re-split them (an all-gather of every
    device's rows), and its backward all-gathered the whole batch's ``[B, S, H]`` cotangent
    onto every device (1.07 GB per step for bench-moe on 8 devices). Gathering the table
    (its ``vocab`` split, if any, kept) makes the lookup local to each device's rows.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return embed
    spec = jax.sharding.PartitionSpec(jax.sharding.PartitionSpec.UNCONSTRAINED, None)
    return jax.lax.with_sharding_constraint(embed, spec)


def _split_runs(
    runs: list[tuple[bool, int, int, int]], cut: int
) -> list[tuple[bool, int, int, int]]:
    """`layer_runs` with every layer before ``cut`` on its own (DeepStack adds after it)."""
    out = []
    for is_moe, start, end, kind_start in runs:
        for i in range(start, min(end, cut)):
            out.append((is_moe, i, i + 1, kind_start + i - start))
        if end > max(start, cut):
            first = max(start, cut)
            out.append((is_moe, first, end, kind_start + first - start))
    return out


class _DeepStack(NamedTuple):
    """DeepStack features laid out by token group: features [G, D, M, H], is_image [G, T]."""

    features: jax.Array
    is_image: jax.Array
    shape: tuple[int, int]

    @property
    def levels(self) -> int:
        return self.features.shape[1]

    def add(self, x: jax.Array, level: int) -> jax.Array:
        """``x + features[level]`` at the image tokens (HF ``_deepstack_process``)."""
        rows = gather_rows(self.features[:, level], self.is_image)  # [G, T, H]
        rows = rows.reshape(*self.shape, -1).astype(x.dtype)
        image = self.is_image.reshape(self.shape)[..., None]
        return jnp.where(image, x + rows, x)


def _merge_vision(
    params: Params,
    config: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    input_ids: jax.Array,
    x: jax.Array,
    pixel_values: jax.Array | None,
    image_grid_thw: jax.Array | None,
    image_features: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, _DeepStack]:
    """Runs the vision tower (or takes its ``image_features``) and puts them at the image tokens.

    Layouts: flat ``pixel_values [N, P]`` + ``image_grid_thw [n, 3]`` (HF: images in row-major
    token order over the whole batch), or per row ``[B, Np, P]`` + ``[B, m, 3]`` (row b's images
    fill row b's image tokens; the tower attends within each row's images, sharded like the
    batch); ``image_features`` per row: ``[B, M, H]`` + ``[B, D, M, H]``.
    """
    if not isinstance(config, Qwen3VLMoeConfig):
        raise ValueError("pixel_values need a Qwen3VLMoeConfig (a qwen3_vl_moe checkpoint)")
    b, s, h = x.shape
    is_image = input_ids == config.image_token_id  # [B, S]
    if image_features is not None:
        feats, deep = image_features  # [B, M, H], [B, D, M, H]
        if feats.ndim != 3 or feats.shape[0] != b or deep.shape[0] != b:
            raise ValueError(f"image_features {feats.shape}: need [B={b}, M, H] per row")
        x = scatter_rows(feats, is_image, x)  # row b's features fill row b's image tokens
        return x, _DeepStack(deep, is_image, (b, s))
    if image_grid_thw is None or pixel_values is None:
        raise ValueError("pixel_values need image_grid_thw")
    tower = functools.partial(vision_tower, params, config.vision, runtime)
    if pixel_values.ndim == 2:
        out = tower(pixel_values, image_grid_thw)
        feats, deep = out.embeds[None], out.deepstack[None]  # [1, M, H], [1, D, M, H]
        groups = is_image.reshape(1, b * s)
    elif pixel_values.ndim == 3 and pixel_values.shape[0] == b:
        pixel_values = layers.constrain_batch(pixel_values, runtime.activation_batch_axes)
        out = tower(pixel_values, image_grid_thw)  # rows of images: [B, ...] in, [B, ...] out
        feats, deep = out.embeds, out.deepstack  # [B, M, H], [B, D, M, H]
        groups = is_image
    else:
        raise ValueError(f"pixel_values shape {pixel_values.shape}: need [N, P] or [B={b}, N, P]")
    x = scatter_rows(feats, groups, x.reshape(groups.shape[0], -1, h)).reshape(b, s, h)
    return x, _DeepStack(deep, groups, (b, s))


def _slice(tree: dict[str, jax.Array], start: int, end: int) -> dict[str, jax.Array]:
    return {k: v[start:end] for k, v in tree.items()}


def unembed_matrix(params: Params, config: Qwen3MoeConfig) -> Float[Array, "H V"]:
    """The [H, V] output projection: lm_head, or embedding^T when tied."""
    top = params["top"]
    return top["embed"].T if config.tie_word_embeddings else top["lm_head"]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_values(config: Qwen3MoeConfig, dtype: str, key: jax.Array) -> dict[str, jax.Array]:
    """Random init of every parameter in one jitted call: normal(0, init range) or ones.

    Uses the "rbg" PRNG (XLA RngBitGenerator) seeded from ``key``: it compiles in a fraction of
    threefry's time on CPU and shards cleanly; init values may differ across backends.
    """
    specs = param_specs(config)
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    seed = data.reshape(-1)[:2].astype(jnp.uint32)
    rbg = jax.random.wrap_key_data(jnp.concatenate([seed, seed]), impl="rbg")
    keys = jax.random.split(rbg, len(specs))
    out = {}
    for k, (name, spec) in zip(keys, specs.items(), strict=True):
        if spec.init in ("ones", "zeros"):
            out[name] = (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, dtype)
        else:
            std = config.initializer_range if spec.std is None else spec.std
            out[name] = (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)
    return out


class _ParamGroup(nnx.Module):
    """A flat group of parameters (one per `ParamSpec`), set as attributes."""

    def __init__(self, values: dict[str, nnx.Param]):
        for name, value in values.items():
            setattr(self, name, value)


class Policy(nnx.Module):
    """Qwen3-MoE causal LM (HF ``Qwen3MoeForCausalLM``) in Flax NNX, or Qwen3-VL-MoE.

    With a `Qwen3VLMoeConfig` it is HF ``Qwen3VLMoeForConditionalGeneration``.
    Parameters live in groups ``top`` (embed, final_norm, lm_head), ``attn`` (stacked over all
    layers), ``moe`` (stacked over MoE layers) and ``mlp`` (stacked over dense layers), plus
    ``vision``, ``vision_blocks`` and ``deepstack`` for Qwen3-VL; each ``nnx.Param`` carries
    ``logical_axes`` metadata for `osworld_jax.model.sharding`.
    """

    def __init__(
        self,
        config: Qwen3MoeConfig,
        runtime: ModelRuntimeConfig | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.runtime = runtime or ModelRuntimeConfig()
        values = _init_values(config, self.runtime.dtype, rngs.params())
        specs = param_specs(config)
        groups: dict[str, dict[str, nnx.Param]] = {}
        for key, value in values.items():
            group, name = key.split(".")
            groups.setdefault(group, {})[name] = nnx.Param(value, logical_axes=specs[key].axes)
        self.top = _ParamGroup(groups.pop("top"))
        self.attn = _ParamGroup(groups.pop("attn"))
        self.moe = _ParamGroup(groups.pop("moe", {}))
        self.mlp = _ParamGroup(groups.pop("mlp", {}))
        for group, values in groups.items():  # the vision tower's groups
            setattr(self, group, _ParamGroup(values))

    def params(self) -> Params:
        """The parameter values as a nested dict ``{group: {name: array}}``."""
        out: Params = {}
        for key in param_specs(self.config):
            group, name = key.split(".")
            out.setdefault(group, {})[name] = getattr(getattr(self, group), name)[...]
        return out

    def unembed(self) -> Float[Array, "H V"]:
        """The [H, V] output projection (lm_head, or embedding^T when tied)."""
        return unembed_matrix(self.params(), self.config)

    def __call__(
        self,
        input_ids: Int[Array, "B S"],
        *,
        positions: Int[Array, "B S"] | Int[Array, "3 B S"] | None = None,
        segment_ids: Int[Array, "B S"] | None = None,
        replay_experts: Int[Array, "B S L K"] | None = None,
        kv_cache: KVCache | None = None,
        return_logits: bool = True,
        pixel_values: jax.Array | None = None,
        image_grid_thw: jax.Array | None = None,
        cache_positions: Int[Array, "B S"] | None = None,
    ) -> PolicyOutput:
        """Runs the model on packed rows.

        Args:
          input_ids: i32[B, S] token ids.
          positions: i32[B, S] position ids (default ``arange(S)`` per row), or the M-RoPE
            i32[3, B, S] of `mrope_positions` (Qwen3-VL; computed here from ``input_ids`` and
            ``image_grid_thw`` when omitted with concrete inputs).
          segment_ids: i32[B, S]; attention stays within equal non-zero ids; 0 = padding
            (default all ones). Ignored with a KV cache (each row is one sequence).
          replay_experts: i32[B, S, L, K] R3 routes (rows of -1 route live); validate on the
            host with `validate_replay` first.
          kv_cache: a `KVCache` to update and attend over (see module docstring).
          return_logits: False returns only ``hidden`` (for chunked logprobs via `unembed`).
          pixel_values: f32[N, 3 T P P] patches of `ImageProcessor` (or [B, Np, 3 T P P] per row,
            rows padded with trailing padding patches); Qwen3-VL only.
          image_grid_thw: i32[n, 3] (or [B, m, 3] per row, unused slots t = 0) of those images.
          cache_positions: i32[B, S] KV-cache slots of the tokens (default ``positions``;
            required with a cache and M-RoPE positions).

        Returns:
          `PolicyOutput`.
        """
        if image_grid_thw is not None and isinstance(self.config, Qwen3VLMoeConfig):
            concrete = not any(
                isinstance(a, jax.core.Tracer) for a in (input_ids, image_grid_thw, segment_ids)
            )
            if concrete:
                import numpy as np

                from osworld_jax.model.mrope import check_vision_inputs, mrope_positions

                ids, grid = np.asarray(input_ids), np.asarray(image_grid_thw)
                seg = None if segment_ids is None else np.asarray(segment_ids)
                if pixel_values is not None:
                    check_vision_inputs(ids, pixel_values.shape, grid, self.config)
                if positions is None:
                    positions = jnp.asarray(
                        mrope_positions(ids, grid, self.config, segment_ids=seg)
                    )
        return forward(
            self.params(),
            self.config,
            self.runtime,
            input_ids,
            positions=positions,
            segment_ids=segment_ids,
            replay_experts=replay_experts,
            kv_cache=kv_cache,
            return_logits=return_logits,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            cache_positions=cache_positions,
        )

"""HF checkpoints in and out: ``config.json`` + ``*.safetensors`` <-> `Policy`.

Loading handles single-file and sharded (``model.safetensors.index.json``) checkpoints and
both expert layouts: per-expert ``mlp.experts.{j}.{gate,up,down}_proj.weight`` (what HF
transformers 5.x ``save_pretrained`` writes and SGLang reads) and fused
``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I]. With a mesh every
parameter is built shard by shard with ``jax.make_array_from_callback``, each device reading
only its slice from the memory-mapped files; no full copy ever sits on one device.

Saving writes the per-expert layout (HF 5.x converts it to its fused modules on load).

Qwen3-VL-MoE (``model_type: qwen3_vl_moe``): the LM lives under ``model.language_model.*``, the
ViT under ``model.visual.*`` (patch embedding as HF's Conv3d weight [Hv, C, T, P, P]), the head
at ``lm_head.weight``. Its experts are fused: the published checkpoints store
``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H] (transformers transposes them on load;
its own 5.x ``save_pretrained`` writes the in-memory [E, 2I, H] / [E, H, I]). Both load here,
told apart by the shapes of a layer's two tensors together: when H = 2I ``gate_up_proj`` is
square in both layouts but ``down_proj`` is not, and when H = I the other way round (both are
square only if I = 0), so the non-square one decides; two tensors that disagree, or a layout
no shape decides, are refused naming the tensors (`fused_expert_layout`). Saving writes the
published layout, which transformers and SGLang both load (a square model: transformers'
layout, see `hf_tensors`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from osworld_jax.model.config import ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.errors import CheckpointError
from osworld_jax.model.params import UNSTACKED_GROUPS, param_specs
from osworld_jax.model.policy import Policy
from osworld_jax.model.safetensors_io import SafetensorsFile, write_safetensors
from osworld_jax.model.sharding import ShardingRules, param_shardings
from osworld_jax.model.vl_config import Qwen3VLMoeConfig, VisionConfig

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
VISUAL = "model.visual."


class _Tensors:
    """name -> np.ndarray over all safetensors files of a checkpoint directory."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {f: SafetensorsFile(path / f) for f in sorted(set(weight_map.values()))}
            self._where = {name: files[f] for name, f in weight_map.items()}
        else:
            paths = sorted(path.glob("*.safetensors"))
            if not paths:
                raise CheckpointError(f"{path}: no *.safetensors files")
            self._where = {n: f for p in paths for f in [SafetensorsFile(p)] for n in f.names()}
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from the checkpoint")
        return self._where[name].get(name)


# A reader gives one stacked-slice: read(layer_or_None, rest_index) -> np.ndarray.
Reader = Callable[[int | None, tuple[slice, ...]], np.ndarray]


def _lm_prefix(config: Qwen3MoeConfig) -> str:
    """Where the language model's tensors live."""
    return "model.language_model." if isinstance(config, Qwen3VLMoeConfig) else "model."


def _readers(config: Qwen3MoeConfig, t: _Tensors) -> dict[str, Reader]:
    """One reader per parameter, mapping HF tensors into our [in, out] stacked layout."""
    c = config
    N, KV, D, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    lm = _lm_prefix(c)
    pre = lm + "layers.{}."
    vl = isinstance(c, Qwen3VLMoeConfig)

    def top(name: str, transpose: bool = False) -> Reader:
        def read(_: int | None, idx: tuple[slice, ...]) -> np.ndarray:
            return (t.get(name).T if transpose else t.get(name))[idx]

        return read

    def per_layer(fn: Callable[[str], np.ndarray], layers: tuple[int, ...]) -> Reader:
        def read(layer: int | None, idx: tuple[slice, ...]) -> np.ndarray:
            assert layer is not None
            return fn(pre.format(layers[layer]))[idx]

        return read

    all_layers = tuple(range(c.num_hidden_layers))
    r: dict[str, Reader] = {
        "top.embed": top(lm + "embed_tokens.weight"),
        "top.final_norm": top(lm + "norm.weight"),
        "attn.input_norm": per_layer(lambda p: t.get(p + "input_layernorm.weight"), all_layers),
        "attn.post_norm": per_layer(
            lambda p: t.get(p + "post_attention_layernorm.weight"), all_layers
        ),
        "attn.q_norm": per_layer(lambda p: t.get(p + "self_attn.q_norm.weight"), all_layers),
        "attn.k_norm": per_layer(lambda p: t.get(p + "self_attn.k_norm.weight"), all_layers),
        "attn.q_proj": per_layer(
            lambda p: t.get(p + "self_attn.q_proj.weight").T.reshape(H, N, D), all_layers
        ),
        "attn.k_proj": per_layer(
            lambda p: t.get(p + "self_attn.k_proj.weight").T.reshape(H, KV, D), all_layers
        ),
        "attn.v_proj": per_layer(
            lambda p: t.get(p + "self_attn.v_proj.weight").T.reshape(H, KV, D), all_layers
        ),
        "attn.o_proj": per_layer(
            lambda p: t.get(p + "self_attn.o_proj.weight").T.reshape(N, D, H), all_layers
        ),
    }
    if not c.tie_word_embeddings:
        r["top.lm_head"] = top("lm_head.weight", transpose=True)
    moe_layers, dense_layers = c.moe_layers, c.dense_layers
    if moe_layers:
        r["moe.router"] = per_layer(lambda p: t.get(p + "mlp.gate.weight").T, moe_layers)

        def experts(which: str) -> Reader:
            def read(layer: int | None, idx: tuple[slice, ...]) -> np.ndarray:
                assert layer is not None
                p = pre.format(moe_layers[layer]) + "mlp.experts."
                if p + "gate_up_proj" in t:  # fused layout
                    name = p + ("down_proj" if which == "down" else "gate_up_proj")
                    published = fused_expert_layout(t, p, c) == "published"
                    return _fused_as_ours(t.get(name), which, c, published=published)[idx]
                ids = range(c.num_experts)[idx[0]]
                return np.stack(
                    [t.get(f"{p}{j}.{which}_proj.weight").T[idx[1:]] for j in ids], axis=0
                )

            return read

        r |= {"moe.gate": experts("gate"), "moe.up": experts("up"), "moe.down": experts("down")}
    if dense_layers:
        for name in ("gate", "up", "down"):

            def dense(p: str, name: str = name) -> np.ndarray:
                return t.get(p + f"mlp.{name}_proj.weight").T

            r[f"mlp.{name}"] = per_layer(dense, dense_layers)
    if vl:
        assert isinstance(c, Qwen3VLMoeConfig)
        r |= _vision_readers(c.vision, t)
    return r


def fused_expert_layout(t: _Tensors, prefix: str, c: Qwen3MoeConfig) -> str:
    """The file's fused expert layout: "published" or "transformers" (never guessed).

    "published": gate_up [E, H, 2I] / down [E, I, H]; "transformers": [E, 2I, H] / [E, H, I].
    Decided by ``{prefix}gate_up_proj`` and ``{prefix}down_proj`` together: each shape admits
    one or both layouts (both when it is square: H = 2I for gate_up, H = I for down); the
    layout both admit is the file's. Never a guess: shapes that fit no layout, two tensors
    that disagree, or a layout no shape decides raise `CheckpointError` naming the tensors.
    """
    E, H, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
    where = getattr(t, "path", "checkpoint")
    expected = {
        "gate_up_proj": {"transformers": (E, 2 * inter, H), "published": (E, H, 2 * inter)},
        "down_proj": {"transformers": (E, H, inter), "published": (E, inter, H)},
    }
    shapes = {name: tuple(t.shape(prefix + name)) for name in expected}
    admitted = []
    for name, layouts in expected.items():
        fits = {layout for layout, shape in layouts.items() if shape == shapes[name]}
        if not fits:
            want = " or ".join(str(s) for s in layouts.values())
            raise CheckpointError(f"{where}: {prefix}{name}: shape {shapes[name]}, expected {want}")
        admitted.append(fits)
    both = admitted[0] & admitted[1]
    if len(both) == 1:
        return both.pop()
    names = f"{prefix}gate_up_proj {shapes['gate_up_proj']} and {prefix}down_proj " + str(
        shapes["down_proj"]
    )
    if not both:
        raise CheckpointError(f"{where}: {names} are in different fused expert layouts")
    raise CheckpointError(
        f"{where}: {names}: the fused expert layout cannot be told from these shapes "
        f"(H = {H}, moe_intermediate_size = {inter}); refusing to guess"
    )


def _fused_as_ours(w: np.ndarray, which: str, c: Qwen3MoeConfig, *, published: bool) -> np.ndarray:
    """A fused expert tensor as our [E, H, I] (gate/up) or [E, I, H] (down) (lazy views).

    transformers' in-memory layout is gate_up [E, 2I, H] / down [E, H, I]; the published
    Qwen3-VL-MoE files hold their transposes (``published``; see `fused_expert_layout`).
    """
    if not published:
        w = np.swapaxes(w, 1, 2)  # now [E, H, 2I] / [E, I, H]
    inter = c.moe_intermediate_size
    if which == "gate":
        return w[:, :, :inter]
    if which == "up":
        return w[:, :, inter:]
    return w


def _vision_readers(v: VisionConfig, t: _Tensors) -> dict[str, Reader]:
    """Readers of the ViT (``model.visual.*``) into the ``vision*`` / ``deepstack`` groups."""
    Hv, Nh, Dh = v.hidden_size, v.num_heads, v.head_dim

    def one(name: str, fn: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> Reader:
        def read(_: int | None, idx: tuple[slice, ...]) -> np.ndarray:
            return fn(t.get(VISUAL + name))[idx]

        return read

    def stacked(fmt: str, fn: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> Reader:
        def read(i: int | None, idx: tuple[slice, ...]) -> np.ndarray:
            assert i is not None
            return fn(t.get(VISUAL + fmt.format(i)))[idx]

        return read

    def tr(a: np.ndarray) -> np.ndarray:
        return a.T

    r: dict[str, Reader] = {
        # Conv3d [Hv, C, T, P, P] (or an already flattened [Hv, C T P P]) -> [C T P P, Hv]
        "vision.patch_embed": one("patch_embed.proj.weight", lambda a: a.reshape(Hv, -1).T),
        "vision.patch_bias": one("patch_embed.proj.bias"),
        "vision.pos_embed": one("pos_embed.weight"),
        "vision.merger_norm": one("merger.norm.weight"),
        "vision.merger_norm_bias": one("merger.norm.bias"),
        "vision.merger_fc1": one("merger.linear_fc1.weight", tr),
        "vision.merger_fc1_bias": one("merger.linear_fc1.bias"),
        "vision.merger_fc2": one("merger.linear_fc2.weight", tr),
        "vision.merger_fc2_bias": one("merger.linear_fc2.bias"),
        "vision_blocks.norm1": stacked("blocks.{}.norm1.weight"),
        "vision_blocks.norm1_bias": stacked("blocks.{}.norm1.bias"),
        "vision_blocks.norm2": stacked("blocks.{}.norm2.weight"),
        "vision_blocks.norm2_bias": stacked("blocks.{}.norm2.bias"),
        "vision_blocks.qkv": stacked(
            "blocks.{}.attn.qkv.weight", lambda a: a.T.reshape(Hv, 3, Nh, Dh)
        ),
        "vision_blocks.qkv_bias": stacked(
            "blocks.{}.attn.qkv.bias", lambda a: a.reshape(3, Nh, Dh)
        ),
        "vision_blocks.proj": stacked(
            "blocks.{}.attn.proj.weight", lambda a: a.T.reshape(Nh, Dh, Hv)
        ),
        "vision_blocks.proj_bias": stacked("blocks.{}.attn.proj.bias"),
        "vision_blocks.fc1": stacked("blocks.{}.mlp.linear_fc1.weight", tr),
        "vision_blocks.fc1_bias": stacked("blocks.{}.mlp.linear_fc1.bias"),
        "vision_blocks.fc2": stacked("blocks.{}.mlp.linear_fc2.weight", tr),
        "vision_blocks.fc2_bias": stacked("blocks.{}.mlp.linear_fc2.bias"),
    }
    if v.deepstack_visual_indexes:
        ds = "deepstack_merger_list.{}."
        r |= {
            "deepstack.norm": stacked(ds + "norm.weight"),
            "deepstack.norm_bias": stacked(ds + "norm.bias"),
            "deepstack.fc1": stacked(ds + "linear_fc1.weight", tr),
            "deepstack.fc1_bias": stacked(ds + "linear_fc1.bias"),
            "deepstack.fc2": stacked(ds + "linear_fc2.weight", tr),
            "deepstack.fc2_bias": stacked(ds + "linear_fc2.bias"),
        }
    return r


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: Any = None,
    mesh: Mesh | None = None,
    runtime: ModelRuntimeConfig | None = None,
    rules: ShardingRules | None = None,
) -> Policy:
    """Reads a HF Qwen3-MoE or Qwen3-VL-MoE checkpoint directory into a `Policy`.

    Args:
      path: directory with ``config.json`` and ``*.safetensors``.
      dtype: parameter dtype (default: ``runtime.dtype`` if a runtime is given, else bfloat16).
      mesh: when given, parameters are created sharded by ``rules`` on it.
      runtime: the runtime config (expert backend, remat, ...).
      rules: sharding rules (default `ShardingRules()`).

    Returns:
      The policy, with ``policy.runtime.dtype`` equal to the parameter dtype.
    """
    path = Path(path)
    config = Qwen3MoeConfig.from_json(path / "config.json")
    if dtype is None:
        dtype = jnp.dtype(runtime.dtype) if runtime is not None else jnp.bfloat16
    dtype = jnp.dtype(dtype)
    runtime = ModelRuntimeConfig(
        **{**(runtime.__dict__ if runtime is not None else {}), "dtype": dtype.name}
    )
    tensors = _Tensors(path)
    readers = _readers(config, tensors)
    specs = param_specs(config)
    nested = param_shardings(config, mesh, rules) if mesh is not None else None
    single = SingleDeviceSharding(jax.devices()[0])
    abstract = nnx.eval_shape(lambda: Policy(config, runtime, rngs=nnx.Rngs(0)))
    for key, spec in specs.items():
        read = readers[key]
        stacked = key.split(".")[0] not in UNSTACKED_GROUPS

        def callback(index: tuple[slice, ...], read=read, stacked=stacked, key=key, spec=spec):
            index = tuple(index) + (slice(None),) * (len(spec.shape) - len(tuple(index)))
            if not stacked:
                out = read(None, index)
            else:
                layers = range(spec.shape[0])[index[0]]
                out = np.stack([read(i, index[1:]) for i in layers], axis=0)
            expect = tuple(len(range(n)[s]) for n, s in zip(spec.shape, index, strict=True))
            if out.shape != expect:
                raise CheckpointError(f"{path}: {key}: slice shape {out.shape} != {expect}")
            return np.asarray(out, dtype=dtype)

        group, name = key.split(".")
        sharding = nested[group][name] if nested is not None else single
        arr = jax.make_array_from_callback(spec.shape, sharding, callback)  # type: ignore[arg-type]
        getattr(getattr(abstract, group), name).set_value(arr)
    return abstract


def hf_tensors(
    params: Mapping[str, Mapping[str, Any]], config: Qwen3MoeConfig, *, on_device: bool = False
) -> Iterator[tuple[str, Any]]:
    """Yields ``(hf_name, numpy array)`` in the HF layout, one layer at a time.

    ``on_device``: yield jax arrays on one local device instead (the same names, shapes, dtypes
    and values: every step is a slice, transpose, reshape or concatenation, exact in either
    place), so an in-memory refit (`osworld_jax.trainer.sglang_weights`) never copies a
    parameter to the host. The arrays must be addressable by this process.

    Qwen3-MoE: per-expert tensors. Qwen3-VL-MoE: the published fused layout (see module
    docstring) plus the ViT; a model whose fused tensors would be square in it (H = 2I or
    H = I) gets transformers' layout instead ([E, 2I, H] / [E, H, I]): transformers keeps a
    tensor whose shape equals its own as it is and transposes the others, so only its layout
    round-trips there (`fused_expert_layout` reads either; real Qwen3-VL-MoE is never square).
    ``params`` is `Policy.params()` (or the same tree of numpy arrays).
    """
    c = config
    H = c.hidden_size
    vl = isinstance(c, Qwen3VLMoeConfig)
    lm = _lm_prefix(c)
    square = H in (2 * c.moe_intermediate_size, c.moe_intermediate_size)
    leaf = _on_one_device if on_device else _to_host
    xp: Any = jnp if on_device else np

    top = params["top"]
    yield lm + "embed_tokens.weight", leaf(top["embed"])
    yield lm + "norm.weight", leaf(top["final_norm"])
    if not c.tie_word_embeddings:
        yield "lm_head.weight", leaf(top["lm_head"]).T
    a = params["attn"]
    moe_index = {layer: m for m, layer in enumerate(c.moe_layers)}
    dense_index = {layer: d for d, layer in enumerate(c.dense_layers)}
    for i in range(c.num_hidden_layers):
        p = f"{lm}layers.{i}."
        yield p + "input_layernorm.weight", leaf(a["input_norm"][i])
        yield p + "post_attention_layernorm.weight", leaf(a["post_norm"][i])
        yield p + "self_attn.q_norm.weight", leaf(a["q_norm"][i])
        yield p + "self_attn.k_norm.weight", leaf(a["k_norm"][i])
        for name in ("q_proj", "k_proj", "v_proj"):
            yield p + f"self_attn.{name}.weight", leaf(a[name][i]).reshape(H, -1).T
        yield p + "self_attn.o_proj.weight", leaf(a["o_proj"][i]).reshape(-1, H).T
        if i in moe_index:
            m = moe_index[i]
            yield p + "mlp.gate.weight", leaf(params["moe"]["router"][m]).T
            w = {n: leaf(params["moe"][n][m]) for n in ("gate", "up", "down")}
            if vl:  # fused: published [E, H, 2I] / [E, I, H], transposed when square (doc)
                gate_up = xp.concatenate([w["gate"], w["up"]], -1)
                down = w["down"]
                if square:
                    gate_up, down = xp.swapaxes(gate_up, 1, 2), xp.swapaxes(down, 1, 2)
                yield p + "mlp.experts.gate_up_proj", gate_up
                yield p + "mlp.experts.down_proj", down
                continue
            for j in range(c.num_experts):
                for n in ("gate", "up", "down"):
                    yield p + f"mlp.experts.{j}.{n}_proj.weight", w[n][j].T
        else:
            d = dense_index[i]
            for n in ("gate", "up", "down"):
                yield p + f"mlp.{n}_proj.weight", leaf(params["mlp"][n][d]).T
    if vl:
        assert isinstance(c, Qwen3VLMoeConfig)
        yield from _vision_tensors(params, c.vision, leaf)


def _to_host(x: Any) -> np.ndarray:
    """A numpy copy of ``x`` (multi-host: all-gathered first)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _on_one_device(x: Any) -> jax.Array:
    """``x`` as a jax array on one device of this process (a sharded array is gathered there,
    device to device); never through the host."""  # noqa: D205, D209
    if not isinstance(x, jax.Array):
        return jnp.asarray(x)
    if not x.is_fully_addressable:
        raise ValueError(
            "hf_tensors(on_device=True) needs parameters this process can address; a multi-host "
            "array is gathered through the host (on_device=False) or broadcast per process"
        )
    devices = x.sharding.device_set
    if len(devices) == 1:
        return x
    first = next(d for d in jax.local_devices() if d in devices)
    return jax.device_put(x, SingleDeviceSharding(first))


def _vision_tensors(
    params: Mapping[str, Mapping[str, Any]],
    v: VisionConfig,
    leaf: Callable[[Any], Any] = _to_host,
) -> Iterator[tuple[str, Any]]:
    """The ViT in HF names and layouts (the inverse of `_vision_readers`); ``leaf`` fetches a
    leaf (`_to_host`, or `_on_one_device` for an in-memory export)."""  # noqa: D205, D209
    top, blocks = params["vision"], params["vision_blocks"]
    Hv = v.hidden_size
    conv = (Hv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    yield VISUAL + "patch_embed.proj.weight", leaf(top["patch_embed"]).T.reshape(conv)
    yield VISUAL + "patch_embed.proj.bias", leaf(top["patch_bias"])
    yield VISUAL + "pos_embed.weight", leaf(top["pos_embed"])
    for i in range(v.depth):
        p = f"{VISUAL}blocks.{i}."
        b = {k: leaf(x[i]) for k, x in blocks.items()}
        yield p + "norm1.weight", b["norm1"]
        yield p + "norm1.bias", b["norm1_bias"]
        yield p + "norm2.weight", b["norm2"]
        yield p + "norm2.bias", b["norm2_bias"]
        yield p + "attn.qkv.weight", b["qkv"].reshape(Hv, -1).T
        yield p + "attn.qkv.bias", b["qkv_bias"].reshape(-1)
        yield p + "attn.proj.weight", b["proj"].reshape(-1, Hv).T
        yield p + "attn.proj.bias", b["proj_bias"]
        yield p + "mlp.linear_fc1.weight", b["fc1"].T
        yield p + "mlp.linear_fc1.bias", b["fc1_bias"]
        yield p + "mlp.linear_fc2.weight", b["fc2"].T
        yield p + "mlp.linear_fc2.bias", b["fc2_bias"]
    mergers = [
        (
            "merger.",
            {k[len("merger_") :]: leaf(x) for k, x in top.items() if k.startswith("merger_")},
        )
    ]
    ds = params.get("deepstack", {})
    for j in range(len(v.deepstack_visual_indexes)):
        mergers.append((f"deepstack_merger_list.{j}.", {k: leaf(x[j]) for k, x in ds.items()}))
    for prefix, w in mergers:
        yield VISUAL + prefix + "norm.weight", w["norm"]
        yield VISUAL + prefix + "norm.bias", w["norm_bias"]
        yield VISUAL + prefix + "linear_fc1.weight", w["fc1"].T
        yield VISUAL + prefix + "linear_fc1.bias", w["fc1_bias"]
        yield VISUAL + prefix + "linear_fc2.weight", w["fc2"].T
        yield VISUAL + prefix + "linear_fc2.bias", w["fc2_bias"]


def write_hf_dir(
    directory: Path,
    config: Qwen3MoeConfig,
    tensors: Iterator[tuple[str, np.ndarray]],
    *,
    torch_dtype: str,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Writes ``config.json`` + safetensors shards (+ index when more than one) to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    names: list[list[str]] = [[]]
    tmp_files: list[Path] = []

    def flush() -> None:
        f = directory / f"shard-{len(tmp_files):05d}.tmp"
        write_safetensors(f, shards[-1])
        tmp_files.append(f)
        shards[-1] = {}

    for name, arr in tensors:
        if sizes[-1] and sizes[-1] + arr.nbytes > max_shard_bytes:
            flush()
            shards.append({})
            sizes.append(0)
            names.append([])
        shards[-1][name] = np.ascontiguousarray(arr)
        sizes[-1] += arr.nbytes
        names[-1].append(name)
    flush()
    if len(tmp_files) == 1:
        tmp_files[0].rename(directory / "model.safetensors")
    else:
        n = len(tmp_files)
        weight_map: dict[str, str] = {}
        for k, (f, shard_names) in enumerate(zip(tmp_files, names, strict=True)):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            f.rename(directory / final)
            weight_map |= dict.fromkeys(shard_names, final)
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = config.to_hf_dict(torch_dtype=torch_dtype)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))


def save_hf_checkpoint(
    policy: Policy,
    path: str | Path,
    *,
    copy_files_from: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Writes ``policy`` as a HF checkpoint directory that transformers and SGLang load.

    Atomic: everything is written into ``path.tmp-*`` and renamed onto ``path`` at the end (an
    existing ``path`` is replaced). Tokenizer / generation-config files are copied from
    ``copy_files_from`` when given. Multi-host: every process must call it (the tensors are
    gathered collectively); only process 0 writes.
    """
    path = Path(path)
    if jax.process_index() != 0:
        for _ in hf_tensors(policy.params(), policy.config):
            pass  # take part in the collective gathers
        return path
    tmp = path.parent / f"{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    dtype = jnp.dtype(policy.runtime.dtype).name
    try:
        tensors = hf_tensors(policy.params(), policy.config)
        write_hf_dir(
            tmp, policy.config, tensors, torch_dtype=dtype, max_shard_bytes=max_shard_bytes
        )
        if copy_files_from is not None:
            for name in _TOKENIZER_FILES:
                src = Path(copy_files_from) / name
                if src.exists():
                    shutil.copy2(src, tmp / name)
        old = None
        if path.exists():
            old = path.parent / f"{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path

"""HF checkpoints in and out: ``config.json`` + ``*.safetensors`` <-> `Policy`.

Loading handles single-file and sharded (``model.safetensors.index.json``) checkpoints and
both expert layouts: per-expert ``mlp.experts.{j}.{gate,up,down}_proj.weight`` (what HF
transformers 5.x ``save_pretrained`` writes and SGLang reads) and fused
``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I]. With a mesh every
parameter is built shard by shard with ``jax.make_array_from_callback``, each device reading
only its slice from the memory-mapped files; no full copy ever sits on one device.

Saving writes the per-expert layout (HF 5.x converts it to its fused modules on load).
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
from osworld_jax.model.params import param_specs
from osworld_jax.model.policy import Policy
from osworld_jax.model.safetensors_io import SafetensorsFile, write_safetensors
from osworld_jax.model.sharding import ShardingRules, param_shardings

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


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

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from the checkpoint")
        return self._where[name].get(name)


# A reader gives one stacked-slice: read(layer_or_None, rest_index) -> np.ndarray.
Reader = Callable[[int | None, tuple[slice, ...]], np.ndarray]


def _readers(config: Qwen3MoeConfig, t: _Tensors) -> dict[str, Reader]:
    """One reader per parameter, mapping HF tensors into our [in, out] stacked layout."""
    c = config
    N, KV, D, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    inter = c.moe_intermediate_size
    pre = "model.layers.{}."

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
        "top.embed": top("model.embed_tokens.weight"),
        "top.final_norm": top("model.norm.weight"),
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
                    if which == "down":
                        w = t.get(p + "down_proj")  # [E, H, I]
                    else:
                        w = t.get(p + "gate_up_proj")  # [E, 2I, H]
                        w = w[:, :inter] if which == "gate" else w[:, inter:]
                    return np.swapaxes(w[idx[0]], 1, 2)[(slice(None), *idx[1:])]
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
    return r


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: Any = None,
    mesh: Mesh | None = None,
    runtime: ModelRuntimeConfig | None = None,
    rules: ShardingRules | None = None,
) -> Policy:
    """Reads a HF Qwen3-MoE checkpoint directory into a `Policy`.

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
        stacked = key.split(".")[0] != "top"

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
    params: Mapping[str, Mapping[str, Any]], config: Qwen3MoeConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(hf_name, numpy array)`` in the per-expert HF layout, one layer at a time.

    ``params`` is `Policy.params()` (or the same tree of numpy arrays).
    """
    c = config
    H = c.hidden_size

    def host(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # multi-host: all gather
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    top = params["top"]
    yield "model.embed_tokens.weight", host(top["embed"])
    yield "model.norm.weight", host(top["final_norm"])
    if not c.tie_word_embeddings:
        yield "lm_head.weight", host(top["lm_head"]).T
    a = params["attn"]
    moe_index = {layer: m for m, layer in enumerate(c.moe_layers)}
    dense_index = {layer: d for d, layer in enumerate(c.dense_layers)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", host(a["input_norm"][i])
        yield p + "post_attention_layernorm.weight", host(a["post_norm"][i])
        yield p + "self_attn.q_norm.weight", host(a["q_norm"][i])
        yield p + "self_attn.k_norm.weight", host(a["k_norm"][i])
        for name in ("q_proj", "k_proj", "v_proj"):
            yield p + f"self_attn.{name}.weight", host(a[name][i]).reshape(H, -1).T
        yield p + "self_attn.o_proj.weight", host(a["o_proj"][i]).reshape(-1, H).T
        if i in moe_index:
            m = moe_index[i]
            yield p + "mlp.gate.weight", host(params["moe"]["router"][m]).T
            w = {n: host(params["moe"][n][m]) for n in ("gate", "up", "down")}
            for j in range(c.num_experts):
                for n in ("gate", "up", "down"):
                    yield p + f"mlp.experts.{j}.{n}_proj.weight", w[n][j].T
        else:
            d = dense_index[i]
            for n in ("gate", "up", "down"):
                yield p + f"mlp.{n}_proj.weight", host(params["mlp"][n][d]).T


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

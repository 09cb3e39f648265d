"""The embedded server's compiled programs and their memory (`trainer.program_memory` pools).

The engine runs `runner._prefill` once per admitted batch of one length bucket and `runner.
_decode` once per step; both are module-level jits whose parameters and KV cache are arguments.
`server_programs` lowers them with abstract arguments laid out as the runner's (parameters and
cache committed to the first device, the rest host arrays) at the buckets the engine will use,
so no weight is loaded: each prefill length bucket at its batched rows (a Qwen3-VL model's with
the image features of a row's screenshots), the vision tower on one screenshot, and the largest
decode step. With a
persistent compilation cache the server process loads these executables (tuned) instead of
compiling them (`osworld_jax.rl.servers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from osworld_jax.model import KVCache, Qwen3MoeConfig, Qwen3VLMoeConfig
from osworld_jax.model.params import param_specs
from osworld_jax.model.serving import CacheLayout
from osworld_jax.server.buckets import (
    ServingBuckets,
    patch_bucket,
    server_runtimes,
    serving_buckets,
)
from osworld_jax.server.image_embeddings import _encode, feature_bucket
from osworld_jax.server.runner import _decode, _prefill
from osworld_jax.server.sampling import MAX_BANNED
from osworld_jax.trainer.program_memory import ProgramMemory, device_bytes, program_memory

#: What lowers a server program's transient (the refusal's knob).
SERVER_KNOB = (
    "ServerConfig.max_running_requests or its --context-length / --max-prefill-batch "
    "(ServerConfig.extra_args)"
)


def layout_buckets(
    layout: CacheLayout,
    min_bucket: int = 16,
    max_prefill_batch: int = 8,
    extra_lengths: Sequence[int] = (),
) -> ServingBuckets:
    """The engine's bucket set for ``layout`` (`runner.serving_buckets`, as `ModelRunner`)."""
    return serving_buckets(
        slot_len=layout.slot_len,
        num_slots=layout.slots,
        min_bucket=min_bucket,
        max_prefill_batch=max_prefill_batch,
        extra_lengths=extra_lengths,
    )


def prefill_rows(bucket: int, max_prefill_batch: int) -> int:
    """Rows of a batched prefill of length ``bucket`` (`ServingBuckets.prefill_rows`)."""
    return ServingBuckets((bucket,), (1,), max(1, max_prefill_batch)).prefill_rows(bucket)


def prefill_buckets(layout: CacheLayout, min_bucket: int) -> tuple[int, ...]:
    """Every prefill length bucket of the engine (`ServingBuckets.lengths`)."""
    return layout_buckets(layout, min_bucket).lengths


def abstract_params(model: Qwen3MoeConfig, dtype: str) -> dict[str, dict[str, Any]]:
    """The served parameters as ``ShapeDtypeStruct``s on the first device (no weights read)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out: dict[str, dict[str, Any]] = {}
    for key, spec in param_specs(model).items():
        group, name = key.split(".")
        out.setdefault(group, {})[name] = jax.ShapeDtypeStruct(
            spec.shape, np.dtype(dtype), sharding=sharding
        )
    return out


def _sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


def _samp(rows: int) -> dict[str, jax.ShapeDtypeStruct]:
    f32, i32 = np.float32, np.int32
    return {
        "temperature": _sds((rows,), f32),
        "top_p": _sds((rows,), f32),
        "top_k": _sds((rows,), i32),
        "min_p": _sds((rows,), f32),
        "banned": _sds((rows, MAX_BANNED), i32),
        "keys": _sds((rows, 2), np.uint32),
        "step": _sds((rows,), i32),
        "logprob_temperature": _sds((rows,), f32),
    }


def server_programs(
    model: Qwen3MoeConfig,
    layout: CacheLayout,
    *,
    dtype: str,
    min_bucket: int = 16,
    max_prefill_batch: int = 8,
    expert_backend: str = "auto",
    mm_attention: str = "cudnn",
    scan_layers: bool | None = None,
    patches: int = 0,
    image_slots: int = 1,
    buckets: Sequence[int] | None = None,
    decode_steps: int = 1,
    extra_lengths: Sequence[int] = (),
    decode_expert_backend: str | None = None,
) -> list[ProgramMemory]:
    """The server's prefill buckets (and its vision tower) and its largest decode, compiled.

    Args:
      model: the served architecture.
      layout: its KV cache (`server.memory.engine_layout`).
      dtype: the serving dtype (parameters, activations, cache).
      min_bucket, max_prefill_batch, expert_backend, mm_attention, scan_layers: the engine's
        (`EngineConfig`; ``scan_layers`` None: on an accelerator).
      patches: the patches of a prompt's images (a Qwen3-VL run's screenshots in context);
        0: text prefills only.
      image_slots: images per prompt (``patches`` is their sum: one image's are its share).
      buckets: the prefill length buckets to plan (default: every one, `prefill_buckets`).
      decode_steps: decode steps per call (``--num-continuous-decode-steps``).
      extra_lengths: length buckets beside the powers of two (``--extra-length-buckets``).
      decode_expert_backend: the decode's expert backend (``--decode-expert-backend``).
    """
    runtime, decode_runtime = server_runtimes(
        dtype, expert_backend, mm_attention, scan_layers, decode_expert_backend
    )
    params = abstract_params(model, dtype)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shape = (model.num_hidden_layers, layout.slots, layout.slot_len, model.num_key_value_heads,
             model.head_dim)  # fmt: skip
    kv: Any = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=single)
    cache = KVCache(kv, kv)
    persistent = device_bytes(params) + device_bytes(cache)
    statics = dict(config=model, runtime=runtime, num_top=0)
    out: list[ProgramMemory] = []

    def keep(name: str, compiled: Any) -> None:
        out.append(
            program_memory(name, compiled, stream="server", persistent=persistent, knob=SERVER_KNOB)
        )

    vl = isinstance(model, Qwen3VLMoeConfig) and patches > 0
    planned = layout_buckets(layout, min_bucket, max_prefill_batch, extra_lengths)
    tokens = 0
    if vl:  # the tower: one image at a time (`image_embeddings._encode`), then the LM prefill
        assert isinstance(model, Qwen3VLMoeConfig)
        unit = model.vision.spatial_merge_size**2
        per_image = -(-patches // max(image_slots, 1) // unit) * unit  # one screenshot's patches
        tokens = feature_bucket(patches // unit)  # a row's image tokens, every image new
        np_ = patch_bucket(per_image, unit)
        frames = model.vision.temporal_patch_size
        pp = model.vision.patch_dim // (3 * frames)  # uint8 levels: [Np, C, P P] (3 channels)
        compiled = _encode.lower(
            params, _sds((np_, 3, pp), np.uint8), _sds((), np.int32), _sds((3, 256), np.float32),
            _sds((1, 3), np.int32), config=model, runtime=runtime, tokens=per_image // unit,
            frames=frames,
        ).compile()  # fmt: skip
        keep(f"vision {np_}p", compiled)
    for s in buckets or planned.lengths:
        rows = planned.prefill_rows(s)
        for vision in (False, True) if vl else (False,):
            images = None
            if vision:
                assert isinstance(model, Qwen3VLMoeConfig)
                h, levels = model.hidden_size, len(model.vision.deepstack_visual_indexes)
                images = {
                    "embeds": _sds((rows, tokens, h), dtype),
                    "deep": _sds((rows, levels, tokens, h), dtype),
                    "rope": _sds((3, rows, s), np.int32),
                }
            i32 = np.int32
            compiled = _prefill.lower(
                params, cache, _sds((rows,), i32), _sds((rows, s), i32), None,
                _sds((rows,), i32), _samp(rows), images, attn_len=s, **statics,
            ).compile()  # fmt: skip
            name = f"prefill {rows}x{s}" + (f" {tokens}t" if images else "")
            keep(name, compiled)
    b, attn = layout.slots, layout.slot_len
    i32 = np.int32
    compiled = _decode.lower(
        params, cache, _sds((b,), i32), _sds((b,), i32), _sds((b,), i32), _sds((b,), i32),
        _samp(b), _sds((b,), i32), attn_len=attn, steps=max(1, decode_steps), config=model,
        runtime=decode_runtime, num_top=0,
    ).compile()  # fmt: skip
    keep(f"decode {b}x{attn}", compiled)
    return out


def server_persistent(model: Qwen3MoeConfig, layout: CacheLayout, dtype: str) -> tuple:
    """``(("weights", bytes), ("refit weights", bytes), ("KV cache", bytes))`` of the server.

    A refit from disk loads the new weights beside the old ones (`ServerMemory.total`).
    """
    weights = device_bytes(abstract_params(model, dtype))
    shape = (2, model.num_hidden_layers, layout.slots, layout.slot_len)
    kv = int(np.prod(shape)) * model.num_key_value_heads * model.head_dim
    kv *= np.dtype(dtype).itemsize
    return (("weights", weights), ("refit weights", weights), ("KV cache", kv))


def main(argv: list[str] | None = None) -> int:
    """``python -m osworld_jax.server.program_memory '<json>'``: the programs as JSON lines.

    The run plans its server's programs in a process of the server's own (the client side
    never imports the server room): the JSON holds ``model_path`` (a directory with
    config.json), ``slots``, ``slot_len``, ``context_length`` and `server_programs`' keywords.
    """
    import json
    import sys
    from pathlib import Path

    args = json.loads((argv if argv is not None else sys.argv[1:])[0])
    model = Qwen3MoeConfig.from_json(Path(args.pop("model_path")) / "config.json")
    layout = CacheLayout(args.pop("context_length"), args.pop("slots"), args.pop("slot_len"))
    for p in server_programs(model, layout, **args):
        print(json.dumps(dataclasses.asdict(p)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())

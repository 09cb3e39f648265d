"""A run's memory plan from its compiled programs (`osworld_jax.trainer.program_memory`).

Two layouts:

- **separate processes** (today): the trainer's pool is its share of each device and holds the
  train state and the train step / old-logprob programs; the embedded server's pool is
  ``ServerConfig.device_memory_fraction`` of the device and holds its weights (twice: a refit
  from disk), its KV cache and its prefill / decode programs. Each pool runs one program at a
  time (one stream).
- **colocated** (one jax client for both): one pool holds everything; the trainer's stream and
  the server's stream run at the same time when rollouts overlap training
  (``RLConfig.max_staleness >= 1``), so their largest transients add up.

`compiled_plan` needs the run's accelerator (its programs compile for it); `--validate_only` on
another machine keeps the analytic estimate (`osworld_jax.rl.validate.validate`).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np

from osworld_jax.batch import BatchBounds
from osworld_jax.model import Qwen3MoeConfig
from osworld_jax.model.params import param_specs
from osworld_jax.model.serving import DEFAULT_MIN_BUCKET, CacheLayout, cache_layout
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.trainer.program_memory import (
    AUTOTUNE_RESERVE,
    MemoryPlan,
    MemoryPlanError,
    Pool,
    ProgramMemory,
    colocated_pool,
    trainer_pool,
    trainer_programs,
)

SHARE_KNOB = "ServerConfig.device_memory_fraction"


def embedded_flags(exp: ExperimentConfig) -> argparse.Namespace:
    """The embedded server's flags that size its cache and buckets (``ServerConfig.extra_args``)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--context-length", type=int, default=None)
    flags.add_argument("--max-total-tokens", type=int, default=None)
    flags.add_argument("--min-bucket", type=int, default=DEFAULT_MIN_BUCKET)
    flags.add_argument("--max-prefill-batch", type=int, default=8)
    flags.add_argument("--mm-attention-backend", default="cudnn")
    flags.add_argument("--mm-embedding-cache-mb", type=int, default=512)
    flags.add_argument("--num-continuous-decode-steps", type=int, default=1)
    flags.add_argument("--extra-length-buckets", type=int, nargs="*", default=[])
    flags.add_argument("--decode-expert-backend", default=None)
    args, _ = flags.parse_known_args(list(exp.server.extra_args))
    return args


def embedded_layout(exp: ExperimentConfig, model: Qwen3MoeConfig) -> CacheLayout:
    """The KV cache the run's embedded server allocates (its flags)."""
    args = embedded_flags(exp)
    return cache_layout(
        model,
        max_running_requests=exp.server.max_running_requests,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        min_bucket=args.min_bucket,
    )


def abstract_trainer(exp: ExperimentConfig, model: Qwen3MoeConfig) -> Any:
    """The run's `Trainer` over an abstract policy (no weights): its mesh, bounds, shardings."""
    from flax import nnx

    from osworld_jax.model import Policy, make_mesh
    from osworld_jax.trainer import Trainer

    rl = exp.rl
    runtime = exp.runtime
    policy = nnx.eval_shape(lambda: Policy(model, runtime, rngs=nnx.Rngs(0)))
    m = rl.mesh
    mesh = make_mesh(data=m.data, fsdp=m.fsdp, expert=m.expert, tensor=m.tensor)
    norm = rl.norm_length or exp.rollout.sampling.max_new_tokens * exp.env.max_turns
    bounds = BatchBounds(
        num_owners=rl.num_logical_owners, num_groups=rl.num_prompts, norm_length=norm
    )
    return Trainer(
        exp.trainer, policy, bounds=bounds, temperature=exp.logprob_temperature, mesh=mesh
    )


def compiled_plan(
    exp: ExperimentConfig,
    model: Qwen3MoeConfig,
    *,
    model_path: Any,
    device_bytes: float | None,
    patch_buckets: tuple[int, ...] = (),
    trainer: Any = None,
    colocated: bool = False,
) -> MemoryPlan:
    """Compiles the run's programs and lays them out in pools (module doc).

    Args:
      exp: the run's config.
      model: the policy's architecture.
      model_path: its checkpoint directory (config.json; the server's programs compile in a
        process of the server room's own).
      device_bytes: each device's memory (None: unknown, nothing is refused).
      patch_buckets: the per-row patch buckets of a VL run (`stages.vision_packing`).
      trainer: the run's `Trainer` (default: one over an abstract policy): its jitted
        functions compile here, so the run's first step finds them compiled.
      colocated: the server runs in the trainer's process (one pool).
    """
    from osworld_jax.rl.servers import memory_shares

    colocated = colocated or exp.server.launch == "colocated"
    trainer = trainer if trainer is not None else abstract_trainer(exp, model)
    rl = exp.rl
    lengths = rl.length_buckets or (exp.agent.compaction.max_context_tokens,)
    slots = exp.agent.max_screenshots if patch_buckets else 1
    programs = trainer_programs(
        trainer,
        rows=rl.num_logical_owners,
        lengths=lengths,
        patch_buckets=patch_buckets,
        image_slots=slots,
    )
    gpu = jax.default_backend() != "cpu"
    reserve = AUTOTUNE_RESERVE if gpu else 0
    shares = memory_shares(exp.server)
    embedded = exp.server.launch in ("embedded", "colocated")
    trainer_share = shares[1] if shares is not None and not colocated else 1.0
    cap = None if device_bytes is None else device_bytes * trainer_share
    knob = SHARE_KNOB if shares is not None else ""
    train = trainer_pool(trainer, programs, capacity=cap, reserve=reserve, capacity_knob=knob)
    if not embedded:
        return MemoryPlan((train,))
    server = server_pool(exp, model, model_path, device_bytes, patch_buckets, reserve, colocated)
    if colocated:
        overlap = rl.max_staleness > 0
        return MemoryPlan((colocated_pool(train, server, capacity=device_bytes, overlap=overlap),))
    return MemoryPlan((train, server))


def server_pool(
    exp: ExperimentConfig,
    model: Qwen3MoeConfig,
    model_path: Any,
    device_bytes: float | None,
    patch_buckets: tuple[int, ...],
    reserve: int,
    colocated: bool,
) -> Pool:
    """The embedded server's pool: weights (twice), KV cache, its programs (compiled here)."""
    import json
    import os
    import subprocess
    import sys

    from osworld_jax.rl.servers import _cache_env, memory_shares

    args = embedded_flags(exp)
    layout = embedded_layout(exp, model)
    gpu = jax.default_backend() != "cpu"
    dtype = exp.server.dtype if exp.server.dtype != "auto" else ("bfloat16" if gpu else "float32")
    request = dict(
        model_path=str(model_path),
        context_length=layout.context_length,
        slots=layout.slots,
        slot_len=layout.slot_len,
        dtype=dtype,
        min_bucket=args.min_bucket,
        max_prefill_batch=args.max_prefill_batch,
        expert_backend=exp.runtime.expert_backend,
        mm_attention=args.mm_attention_backend,
        patches=max(patch_buckets, default=0),
        image_slots=exp.agent.max_screenshots,
        decode_steps=args.num_continuous_decode_steps,
        extra_lengths=list(args.extra_length_buckets),
        decode_expert_backend=args.decode_expert_backend,
    )
    if colocated:  # the server shares this process (and its device): compile here
        from osworld_jax.server.colocated import server_program_memory

        programs = [ProgramMemory(**p) for p in server_program_memory(request)]
    else:  # the server room's own process (its own device share), with the run's cache
        done = subprocess.run(
            [sys.executable, "-m", "osworld_jax.server.program_memory", json.dumps(request)],
            capture_output=True,
            text=True,
            env={**os.environ, **_cache_env(exp)},
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise MemoryPlanError(f"memory plan: compiling the server's programs failed: {tail}")
        programs = [ProgramMemory(**json.loads(line)) for line in done.stdout.splitlines() if line]
    weights = sum(int(np.prod(s.shape)) for s in param_specs(model).values())
    weights *= np.dtype(dtype).itemsize
    kv = 2 * model.num_hidden_layers * layout.slots * layout.slot_len
    kv *= model.num_key_value_heads * model.head_dim * np.dtype(dtype).itemsize
    persistent: tuple[tuple[str, int], ...] = (
        ("weights", weights), ("refit weights", weights), ("KV cache", kv),
    )  # fmt: skip
    if patch_buckets:  # the tower's outputs kept by image content (`image_embeddings`)
        persistent += (("image embeddings", args.mm_embedding_cache_mb << 20),)
    shares = memory_shares(exp.server)
    share = shares[0] if shares is not None and not colocated else 1.0
    return Pool(
        name="server",
        capacity=None if device_bytes is None else device_bytes * share,
        persistent=persistent,
        programs=tuple(programs),
        reserve=reserve,
        capacity_knob=f"a larger {SHARE_KNOB}" if shares is not None else "",
    )


def on_accelerator() -> bool:
    """This process's jax runs on an accelerator (the compiled plan is for it)."""
    return jax.default_backend() != "cpu"

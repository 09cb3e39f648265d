"""Train-step throughput: step time, tokens/s and MFU of `osworld_jax.trainer.Trainer`.

    python benchmarks/train_step.py --config tiny           # CPU smoke benchmark
    python benchmarks/train_step.py --config bench-moe      # GPU: Qwen3-30B-A3B shape, 8 layers

Random token ids and random weights (created on device under jit with out_shardings); the full
RL train step: forward with router replay (random valid routes), chunked token logprobs,
policy_loss with the binary-KL gate, backward, AdamW update.

MFU (model FLOPs utilisation), the formula used below:

    MFU = (6 * N_active * tokens + 12 * L * B * S^2 * n_heads * head_dim / 2)
          / step_time / peak_flops

- ``N_active``: parameters touched per token = all parameters, minus the inactive experts'
  share ``(E - K) / E`` of every expert weight, minus the input embedding (a gather: 0 FLOPs);
  the router and the lm head count;
- ``tokens = B * S``; 6 = forward (2) + backward (4) FLOPs per parameter and token;
- the second term is causal attention (QK^T and AV, forward + backward: 12 per
  ``L * B * S^2 * n_heads * head_dim``, halved by the causal mask);
- ``peak_flops`` = 790e12 by default (``--peak-flops``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from osworld_jax.batch import Batch, BatchMeta
from osworld_jax.model import ModelRuntimeConfig, Policy, Qwen3MoeConfig, make_mesh
from osworld_jax.model.params import param_specs
from osworld_jax.trainer import OptimizerConfig, Trainer, TrainerConfig


@dataclasses.dataclass(frozen=True)
class Bench:
    model: Qwen3MoeConfig
    runtime: ModelRuntimeConfig
    batch: int
    seq: int
    logprob_chunk: int


CONFIGS = {
    "tiny": Bench(
        model=Qwen3MoeConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        runtime=ModelRuntimeConfig(dtype="float32", expert_backend="ragged", remat="none"),
        batch=4,
        seq=128,
        logprob_chunk=64,
    ),
    # Qwen3-30B-A3B with 8 layers (all MoE).
    "bench-moe": Bench(
        model=Qwen3MoeConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=40960,
        ),
        runtime=ModelRuntimeConfig(
            dtype="bfloat16", expert_backend="ragged", remat="full", scan_layers=True
        ),
        batch=4,
        seq=4096,
        logprob_chunk=1024,
    ),
}


def active_params(config: Qwen3MoeConfig) -> tuple[int, int]:
    """``(total parameters, active parameters per token)`` (see the module docstring)."""
    total = active = 0
    for key, spec in param_specs(config).items():
        n = math.prod(spec.shape)
        total += n
        if key == "top.embed" and not config.tie_word_embeddings:
            continue  # input embedding: a gather
        if key in ("moe.gate", "moe.up", "moe.down"):
            n = n * config.num_experts_per_tok // config.num_experts
        active += n
    return total, active


def model_flops(config: Qwen3MoeConfig, batch: int, seq: int) -> float:
    """FLOPs of one train step by the formula of the module docstring."""
    _, n_active = active_params(config)
    dense = 6 * n_active * batch * seq
    attn = 12 * config.num_hidden_layers * batch * seq**2 * config.num_attention_heads
    attn = attn * config.head_dim / 2
    return dense + attn


def random_batch(config: Qwen3MoeConfig, batch: int, seq: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    shape = (batch, seq)
    tokens = rng.integers(0, config.vocab_size, shape, dtype=np.int32)
    loss_mask = np.ones(shape, np.float32)
    loss_mask[:, 0] = 0.0
    # Random weights predict ~uniformly: behaviour = -log V keeps the binary-KL gate open.
    behavior = np.where(loss_mask > 0, -math.log(config.vocab_size), 0.0).astype(np.float32)
    L, E, K = config.num_hidden_layers, config.num_experts, config.num_experts_per_tok
    routes = np.argsort(rng.random((batch, seq, L, E), dtype=np.float32), axis=-1)[..., :K]
    return Batch(
        tokens=tokens,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        advantages=rng.normal(size=(batch, 1)).astype(np.float32) * loss_mask,
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy(),
        segment_ids=np.ones(shape, np.int32),
        owner_ids=np.arange(batch, dtype=np.int32),
        group_ids=np.zeros(batch, np.int32),
        row_weight=np.ones(batch, np.float32),
        routed_experts=routes.astype(np.int32),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    p.add_argument("--batch", type=int, help="override B (rows)")
    p.add_argument("--seq", type=int, help="override S (tokens per row)")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--expert-backend", help="override ModelRuntimeConfig.expert_backend")
    p.add_argument("--remat", help="override ModelRuntimeConfig.remat")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--no-replay", action="store_true", help="route live instead of R3")
    p.add_argument("--mesh", default="", help="data,fsdp,expert,tensor (default: all devices fsdp)")
    p.add_argument("--peak-flops", type=float, default=790e12)
    args = p.parse_args(argv)

    bench = CONFIGS[args.config]
    model = bench.model
    if args.layers:
        model = model.replace(num_hidden_layers=args.layers)
    runtime = bench.runtime
    if args.expert_backend:
        runtime = dataclasses.replace(runtime, expert_backend=args.expert_backend)
    if args.remat:
        runtime = dataclasses.replace(runtime, remat=args.remat)
    b, s = args.batch or bench.batch, args.seq or bench.seq

    if args.mesh:
        data, fsdp, expert, tensor = (int(x) for x in args.mesh.split(","))
    else:
        data, fsdp, expert, tensor = 1, jax.device_count(), 1, 1
    mesh = make_mesh(data=data, fsdp=fsdp, expert=expert, tensor=tensor)
    config = TrainerConfig(
        optimizer=OptimizerConfig(learning_rate=5e-6),
        logprob_chunk=bench.logprob_chunk,
        num_micro_batches=args.micro_batches,
        router_replay=not args.no_replay,
    )

    def init_fn() -> Policy:
        return Policy(model, runtime, rngs=nnx.Rngs(0))

    trainer = Trainer(config, nnx.eval_shape(init_fn), mesh=mesh)
    state = trainer.init_state(init_fn=init_fn)
    batch = random_batch(model, b, s)
    meta = BatchMeta(num_owners=b, num_groups=1, norm_length=s)

    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch, meta)  # returns host metrics: synced
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
        elif i == 0:
            compile_s = dt
    jax.block_until_ready(state)

    total, active = active_params(model)
    step = statistics.median(times)
    flops = model_flops(model, b, s)
    rows = [
        (
            "config",
            f"{args.config} ({model.num_hidden_layers} layers, {runtime.expert_backend}, "
            f"{runtime.dtype}, remat={runtime.remat})",
        ),
        (
            "devices",
            f"{jax.device_count()} x {jax.devices()[0].device_kind}, mesh {dict(mesh.shape)}",
        ),
        ("params (total / active)", f"{total / 1e6:,.3f}M / {active / 1e6:,.3f}M"),
        ("batch B x S", f"{b} x {s} = {b * s} tokens"),
        ("first step (compile + run)", f"{compile_s:.2f} s"),
        (
            "step time (median)",
            f"{step * 1e3:.1f} ms  [min {min(times) * 1e3:.1f}, max "
            f"{max(times) * 1e3:.1f}] over {len(times)} steps",
        ),
        ("tokens/s", f"{b * s / step:,.0f}"),
        ("model GFLOP / step", f"{flops / 1e9:,.3f}"),
        ("achieved TFLOP/s", f"{flops / step / 1e12:.6f}"),
        (
            f"MFU (peak {args.peak_flops / 1e12:.0f} TFLOP/s)",
            f"{flops / step / args.peak_flops:.4%}",
        ),
        ("final loss / grad_norm", f"{metrics['loss']:.4f} / {metrics['grad_norm']:.4f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    trainer.close()


if __name__ == "__main__":
    sys.exit(main())

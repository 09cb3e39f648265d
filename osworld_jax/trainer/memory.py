"""Device-memory estimate of one train step, from shapes alone (checked before compiling).

XLA only reports a step's memory after compiling it (minutes for a large model) and a step that
does not fit fails at its first run. `estimate_step_memory` adds up, per device:

- ``params``: the train-state parameters, ``P_t * bytes(master) + P_f * bytes(dtype)``
  (sharded over the parameter axes: fsdp x expert x tensor); ``P_t`` trainable, ``P_f`` frozen
  (``OptimizerConfig.freeze_router`` / ``freeze_vision``): a frozen parameter is held once, in
  the policy's dtype, with no master copy;
- ``compute_copy``: the policy-dtype copy of the trainable parameters the forward runs on
  (``P_t * bytes(dtype)``) when the masters are wider;
- ``moments``: AdamW's mu and nu, ``2 * P_t * bytes(master)`` (none for frozen parameters);
- ``grads``: one gradient tree of the trainable parameters in the policy dtype, plus a float32
  accumulator when ``num_micro_batches > 1`` (the step takes no gradient w.r.t. frozen ones);
- ``activations``: what one micro-batch keeps for its backward (sharded over the batch axes):
  per token and layer, the residual stream, norms, q/k/v/attention output, the router, and the
  MoE's padded expert rows (dispatched x, gate/up/SwiGLU outputs, expert outputs, the combine
  gather) under ``remat="none"``; the layer input only under ``"full"`` (plus one layer's
  worth, recomputed during its backward); the projections but not the expert rows under
  ``"dots"``. Under expert parallelism over ``n`` devices a device's expert rows are sized
  for the worst case, all ``n`` devices' tokens on its ``E / n`` experts
  (`osworld_jax.model.expert_parallel`): ``padded_rows(n T min(K, E/n), E/n)`` rows;
- ``logprobs``: two float32 ``[rows, chunk, V]`` logit blocks, the float32 ``dW`` of the lm head,
  and the saved bf16 ``onehot - p`` when `logprobs.saves_probs` keeps it;
- ``vision`` (Qwen3-VL, ``patches`` per row > 0): what the ViT keeps for its backward per patch
  and block under ``vision_remat`` (else ``remat``): ``"none"`` the block's input, both norms,
  q/k/v and the rotated q/k, the attention output and its softmax statistics, the MLP's
  input and GELU in/out, and the float32 upcasts of the norms, rotary and GELU that XLA keeps
  (``c (11 Hv + 2 I) + 4 (8 Hv + 2 I) + 4 heads`` bytes: 96.7 GiB measured for bench-vl's
  32,640 patches, benchmarks/NOTES.md); ``"dots"`` the block input
  and the matmul outputs (``c (6 Hv + I)``; ``"dots_attention"`` also the attention output,
  ``+ c Hv``); ``"full"`` the block input (plus one block's
  worth, recomputed during its backward); plus the float32 patches, the DeepStack features,
  and the XLA attention's float32 score blocks (``3 x heads x chunk x N`` per row) unless the
  cuDNN packed kernel runs (``attention="cudnn"`` on a GPU: no score buffer). A frozen tower
  (``freeze_vision``) is outside the differentiated function, so it keeps nothing for a
  backward: one block's working set per patch (as ``"full"``'s recompute) plus the features.

The coefficients were checked against XLA's own figures on an H200 (benchmarks/NOTES.md); the
estimate is meant to be a little high (it ignores buffer reuse between layers' temporaries).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from osworld_jax.model.config import ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.freeze import is_frozen_name
from osworld_jax.model.kernels.grouped_matmul import padded_rows
from osworld_jax.model.params import param_specs
from osworld_jax.trainer.config import TrainerConfig
from osworld_jax.trainer.logprobs import saves_probs
from osworld_jax.trainer.state import TrainerError

GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMemory:
    """Estimated bytes per device of one train step (see the module doc for each term)."""

    params: float
    compute_copy: float
    moments: float
    grads: float
    activations: float
    logprobs: float
    vision: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the terms, bytes."""
        return sum(dataclasses.asdict(self).values())

    def describe(self) -> str:
        """``"total X GiB (params a, ...)"``."""
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in dataclasses.asdict(self).items())
        return f"{self.total / GiB:.1f} GiB ({parts})"


def _layer_bytes_per_token(
    model: Qwen3MoeConfig, runtime: ModelRuntimeConfig, tokens: int, expert_parallel: int = 1
):
    """Bytes one layer keeps per token for its backward: (remat none, remat dots)."""
    c = jnp.dtype(runtime.dtype).itemsize
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_key_value_heads * d
    # x, normed x, q, k, v, normed+roped q/k, attention out, x + attn, post-norm y; router f32.
    attn = c * (4 * h + 3 * q + 4 * kv) + 4 * 3 * model.num_experts
    k = model.num_experts_per_tok
    n, e_loc = expert_parallel, model.num_experts // expert_parallel
    rows = padded_rows(n * tokens * min(k, e_loc), e_loc, 128) / tokens  # padded rows per token
    # dispatched x, expert outputs (H each); gate, up, SwiGLU out (I each); combine gather.
    moe = c * (rows * (2 * h + 3 * model.moe_intermediate_size) + k * h)
    mlp = c * 3 * model.intermediate_size
    n_moe = len(model.moe_layers)
    per_layer = attn + (moe * n_moe + mlp * (model.num_hidden_layers - n_moe)) / max(
        model.num_hidden_layers, 1
    )
    return per_layer, attn


def frozen_fraction(model: Qwen3MoeConfig, config: TrainerConfig) -> float:
    """The share of the model's parameters that ``config.optimizer`` freezes (0 to 1)."""
    opt = config.optimizer
    sizes = {name: math.prod(s.shape) for name, s in param_specs(model).items()}
    frozen = sum(
        n
        for name, n in sizes.items()
        if is_frozen_name(name, freeze_router=opt.freeze_router, freeze_vision=opt.freeze_vision)
    )
    return frozen / max(sum(sizes.values()), 1)


def vision_bytes(
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    rows: int,
    patches: int,
    *,
    frozen: bool = False,
) -> float:
    """Bytes the ViT keeps for its backward over ``rows`` rows of ``patches`` patches (doc)."""
    from osworld_jax.model.vl_config import Qwen3VLMoeConfig

    if not isinstance(model, Qwen3VLMoeConfig) or patches <= 0:
        return 0.0
    v = model.vision
    c = jnp.dtype(runtime.dtype).itemsize
    hv, inter, heads = v.hidden_size, v.intermediate_size, v.num_heads
    # bf16 residuals + the float32 upcasts XLA keeps (norms, rotary, GELU): 117.8 KB per
    # patch and block measured on an H200 (Qwen3-VL's tower, remat none), 113.9 KB here.
    full_block = c * (11 * hv + 2 * inter) + 4 * (8 * hv + 2 * inter) + 4 * heads
    remat = runtime.vision_remat or runtime.remat
    if frozen:  # forward only: no residuals kept, one block's working set at a time
        per_patch: float = full_block
    elif remat == "none":
        per_patch = v.depth * full_block
    elif remat == "full":
        per_patch = v.depth * c * hv + full_block
    else:  # dots / dots_with_batch: block input + matmul outputs saved (+ attention output)
        saved = 6 * hv + inter + (hv if remat == "dots_attention" else 0)
        per_patch = v.depth * (c * saved + 4 * heads) + full_block
    levels = 1 + len(v.deepstack_visual_indexes)
    per_patch += 4 * v.patch_dim + levels * c * model.hidden_size / v.spatial_merge_size**2
    scores = 0.0
    if not (runtime.attention == "cudnn" and jax.default_backend() == "gpu"):
        chunk = runtime.vision_attention_chunk or patches
        scores = 3 * 4 * heads * min(chunk, patches) * patches
    return rows * (patches * per_patch + scores)


def estimate_step_memory(
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    config: TrainerConfig,
    *,
    rows: int,
    seq: int,
    param_shards: float = 1,
    batch_shards: int = 1,
    expert_parallel: int = 1,
    patches: int = 0,
) -> StepMemory:
    """Bytes per device of one train step of ``rows x seq`` tokens (module doc).

    Args:
      model: the architecture.
      runtime: dtype and remat policy.
      config: master dtype, micro-batches, logprob chunk.
      rows: batch rows of the optimizer step.
      seq: tokens per row.
      param_shards: devices one parameter is split over (fsdp x expert x tensor), or the
        ratio of all parameters to one device's share when parameters split differently.
      batch_shards: devices the batch rows are split over (the data-parallel size).
      expert_parallel: devices the experts are split over with tokens dispatched to them (the
        mesh's ``expert`` axis when ``ModelRuntimeConfig.expert_parallel``; 1: none).
      patches: image patches per row (``Batch.num_patches``; 0: no images).
    """
    c = jnp.dtype(runtime.dtype).itemsize
    m = c if config.master_dtype is None else jnp.dtype(config.master_dtype).itemsize
    total = sum(math.prod(s.shape) for s in param_specs(model).values()) / param_shards
    n_frozen = total * frozen_fraction(model, config)
    n = total - n_frozen  # trainable: master, compute copy, moments, gradients
    micro_rows = max(rows // (config.num_micro_batches * batch_shards), 1)
    tokens = micro_rows * seq
    per_layer, attn = _layer_bytes_per_token(model, runtime, tokens, expert_parallel)
    layers = model.num_hidden_layers
    h = model.hidden_size
    if runtime.remat == "none":
        act = tokens * layers * per_layer
    elif runtime.remat == "full":
        act = tokens * (layers * c * h + per_layer)
    else:  # dots / dots_with_batch: projections saved, expert rows recomputed
        act = tokens * (layers * attn + per_layer)
    vocab = model.vocab_size
    chunk = min(config.logprob_chunk, seq)
    lp = 2 * micro_rows * chunk * vocab * 4 + h * vocab * 4
    if saves_probs(micro_rows, seq, vocab, runtime.dtype, None):
        lp += micro_rows * seq * vocab * c
    grads = n * c + (n * 4 if config.num_micro_batches > 1 else 0)
    return StepMemory(
        params=n * m + n_frozen * c,
        compute_copy=n * c if m != c else 0.0,
        moments=2 * n * m,
        grads=grads,
        activations=act,
        logprobs=lp,
        vision=vision_bytes(
            model, runtime, micro_rows, patches, frozen=config.optimizer.freeze_vision
        ),
    )


def device_capacity() -> float | None:
    """Usable bytes of this process's first device (its allocator's ``bytes_limit``), or None.

    A local device: multi-host, ``jax.devices()[0]`` belongs to process 0 and the other
    processes cannot ask it.
    """
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return float(limit) if limit else None


def check_step_fits(
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    config: TrainerConfig,
    *,
    rows: int,
    seq: int,
    param_shards: float = 1,
    batch_shards: int = 1,
    expert_parallel: int = 1,
    patches: int = 0,
    capacity: float | None = None,
) -> StepMemory:
    """Raises `TrainerError` (before any compile) when the estimate exceeds ``capacity``.

    The message gives the estimate's terms and what would fit: more micro-batches, another
    remat policy, bfloat16 masters, or more devices. ``capacity`` defaults to
    `device_capacity` (no check where the platform reports none, e.g. the CPU).
    """
    kw: dict[str, Any] = dict(
        rows=rows,
        seq=seq,
        param_shards=param_shards,
        batch_shards=batch_shards,
        expert_parallel=expert_parallel,
        patches=patches,
    )
    est = estimate_step_memory(model, runtime, config, **kw)
    capacity = device_capacity() if capacity is None else capacity
    if capacity is None or est.total <= capacity:
        return est
    options = []
    per_device = max(rows // batch_shards, 1)
    for mb in (2, 4, 8, 16, 32, 64):
        if mb > config.num_micro_batches and per_device % mb == 0:
            cfg = dataclasses.replace(config, num_micro_batches=mb)
            if estimate_step_memory(model, runtime, cfg, **kw).total <= capacity:
                options.append(f"TrainerConfig.num_micro_batches={mb}")
                break
    for remat in ("dots", "full"):
        if remat != runtime.remat:
            rt = dataclasses.replace(runtime, remat=remat)
            if estimate_step_memory(model, rt, config, **kw).total <= capacity:
                options.append(f"ModelRuntimeConfig.remat={remat!r}")
    if patches and (runtime.vision_remat or runtime.remat) != "full":
        rt = dataclasses.replace(runtime, vision_remat="full")
        if estimate_step_memory(model, rt, config, **kw).total <= capacity:
            options.append("ModelRuntimeConfig.vision_remat='full'")
    if config.master_dtype == "float32":
        cfg = dataclasses.replace(config, master_dtype="bfloat16")
        if estimate_step_memory(model, runtime, cfg, **kw).total <= capacity:
            options.append("TrainerConfig.master_dtype='bfloat16' (lossy updates)")
    need = math.ceil(est.total / capacity * param_shards)
    options.append(f"about {need}+ devices on the fsdp axis")
    raise TrainerError(
        f"train step of {rows} rows x {seq} tokens needs ~{est.describe()} per device, over the "
        f"{capacity / GiB:.1f} GiB available (remat={runtime.remat!r}, "
        f"num_micro_batches={config.num_micro_batches}, master_dtype={config.master_dtype!r}); "
        f"would fit: {'; '.join(options)}"
    )

"""Train-step throughput: step time, tokens/s and MFU of `osworld_jax.trainer.Trainer`.

    python benchmarks/train_step.py --config tiny           # CPU smoke benchmark
    python benchmarks/train_step.py --config bench-moe      # GPU: Qwen3-30B-A3B shape, 8 layers
    python benchmarks/train_step.py --config tiny-vl        # CPU smoke: tiny ViT + screenshots
    python benchmarks/train_step.py --config bench-vl       # GPU: bench-moe + Qwen3-VL's ViT
    python benchmarks/train_step.py --config bench-moe --preset mesh_2gpu.gin   # 2 GPUs, B=8

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
- ``peak_flops`` = 790e12 per device by default (``--peak-flops``), times the mesh's devices.

Vision configs (``tiny-vl``, ``bench-vl``: the text model of ``tiny`` / ``bench-moe`` plus a
ViT; ``bench-vl``'s is Qwen3-VL-30B-A3B's, 27 blocks, hidden 1152, MLP 4304, 16 heads, patch 16,
merge 2, DeepStack after blocks 8, 16, 24). Each row holds ``images`` copies of a real
1920x1080 desktop screenshot (``tests/model/assets/desktop_1920x1080.png``) processed by
Qwen3-VL's image processor at its default size limits (1088 x 1920 px -> 68 x 120 = 8,160
patches -> 2,040 image tokens each; ``tiny-vl``: a CPU-sized pixel budget), each as
``<|vision_start|>`` + pads + ``<|vision_end|>`` followed by an equal share of random text; the
image spans have loss mask 0, R3 replays random routes on every token (image tokens included),
positions are the M-RoPE of ``mrope_positions``. The vision tower is trained (not frozen). MFU
adds the ViT's FLOPs to the text formula above (whose ``N_active`` excludes the ViT):

    vision = 3 * [ 2 N (P Hv)                                  patch embedding
                 + 2 N depth (4 Hv^2 + 2 Hv I)                 qkv, proj, fc1, fc2
                 + depth * sum_i 4 n_i^2 Hv                    attention within each image
                 + 2 (N / m^2) (1 + D) ((m^2 Hv)^2 + m^2 Hv Ho) ]  final + D DeepStack mergers

with N patches in the batch (n_i of image i), P = 3 * 2 * 16^2 values per patch, Hv the ViT
width, I its MLP width, m the merge size, Ho the LM width, 3 = forward + backward (norms,
position interpolation and rotary are left out). Attention counts only pairs within one image:
work a kernel spends on masked pairs is not model FLOPs. The HF peer for the vision configs is
``Qwen3VLMoeForConditionalGeneration`` (the same config through ``to_hf_dict``, the same token
ids, pixels and grids; labels -100 on the image spans).

Peers (``--hf-peers``): HF transformers ``Qwen3MoeForCausalLM`` with the same config, bf16,
random weights, ``experts_implementation="grouped_mm"``, sdpa attention: forward (CE loss over
the 151,936 vocab) + backward + clip 1.0 + ``torch.optim.AdamW`` (fused; states in the bf16
parameter dtype), eager and with ``torch.compile(model.forward)``; each peer runs in its own
subprocess before JAX touches the GPU, so all rows come from one run on one machine. Peak memory:
JAX ``peak_bytes_in_use`` / torch ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from osworld_jax.batch import Batch, BatchBounds
from osworld_jax.model import (
    ImageProcessor,
    ModelRuntimeConfig,
    Policy,
    Qwen3MoeConfig,
    Qwen3VLMoeConfig,
    VisionConfig,
    make_mesh,
    mrope_positions,
)
from osworld_jax.model.params import param_specs
from osworld_jax.model.processor import QWEN3_VL_PREPROCESSOR
from osworld_jax.trainer import OptimizerConfig, Trainer, TrainerConfig

REPO = Path(__file__).resolve().parents[1]
SCREENSHOT = REPO / "tests" / "model" / "assets" / "desktop_1920x1080.png"
VL_ASSET = REPO / "osworld_jax" / "model" / "assets" / "qwen3_vl_30b_a3b_instruct" / "config.json"
VISION_GROUPS = ("vision", "vision_blocks", "deepstack")


@dataclasses.dataclass(frozen=True)
class Bench:
    model: Qwen3MoeConfig
    runtime: ModelRuntimeConfig
    batch: int
    seq: int
    logprob_chunk: int
    images: int = 0  # screenshots per row (vision configs)
    preprocessor: dict | None = None  # preprocessor_config.json keys (vision configs)


def with_vision(text: Qwen3MoeConfig, vision: VisionConfig) -> Qwen3VLMoeConfig:
    """``text`` plus a ViT, with Qwen3-VL's vision token ids (clamped into a small vocab)."""
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(Qwen3MoeConfig)}
    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
    ids["vision_end_token_id"] = 151653
    if text.vocab_size <= 151656:  # tiny: the last four ids of the vocabulary
        v = text.vocab_size
        ids = dict(
            vision_start_token_id=v - 4, vision_end_token_id=v - 3, image_token_id=v - 2,
            video_token_id=v - 1,
        )  # fmt: skip
    half = text.head_dim // 2
    section = (24, 20, 20) if half == 64 else (half - 2 * (half // 4), half // 4, half // 4)
    return Qwen3VLMoeConfig(
        **{**fields, "norm_topk_prob": True}, vision=vision, mrope_section=section, **ids
    )


def qwen3_vl_vision(out_hidden_size: int) -> VisionConfig:
    """Qwen3-VL-30B-A3B-Instruct's published vision tower (``vision_config``)."""
    published = json.loads(VL_ASSET.read_text())["vision_config"]
    return VisionConfig.from_hf_dict({**published, "out_hidden_size": out_hidden_size})


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
        runtime=ModelRuntimeConfig(dtype="float32", expert_backend="auto", remat="none"),
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
            dtype="bfloat16",
            expert_backend="auto",
            remat="none",
            scan_layers=True,
            attention="cudnn",
        ),
        batch=4,
        seq=4096,
        logprob_chunk=1024,
    ),
}


# The text models of tiny / bench-moe with a vision tower and screenshots in every row.
CONFIGS["tiny-vl"] = dataclasses.replace(
    CONFIGS["tiny"],
    model=with_vision(
        CONFIGS["tiny"].model,
        VisionConfig(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
            num_position_embeddings=64, deepstack_visual_indexes=(0,),
        ),
    ),
    batch=2,
    seq=512,
    images=2,
    # 1920x1080 within 192^2 px -> 128 x 256 -> 8 x 16 patches -> 32 image tokens.
    preprocessor={**QWEN3_VL_PREPROCESSOR, "size": {"shortest_edge": 4096, "longest_edge": 36864}},
)  # fmt: skip
# bench-moe + Qwen3-VL-30B-A3B's ViT: one row of 16,384 tokens (bench-moe's tokens per step)
# holding 4 screenshots (4 x 2,042 tokens) and 8,216 text tokens. The LM without remat, the ViT
# with remat 'full' (measured on an H200: 1,035.7 ms/step, 79.6 GiB; ViT remat 'none' keeps
# ~97 GiB of ViT residuals and does not fit beside the LM; benchmarks/NOTES.md issue 31).
CONFIGS["bench-vl"] = dataclasses.replace(
    CONFIGS["bench-moe"],
    model=with_vision(CONFIGS["bench-moe"].model, qwen3_vl_vision(2048)),
    runtime=dataclasses.replace(CONFIGS["bench-moe"].runtime, remat="none", vision_remat="full"),
    batch=1,
    seq=16384,
    images=4,
    preprocessor=QWEN3_VL_PREPROCESSOR,
)


def active_params(config: Qwen3MoeConfig) -> tuple[int, int]:
    """``(total parameters, active parameters per token)`` of the language model (see the
    module docstring; a vision tower is counted by `vision_flops`)."""  # noqa: D205, D209
    total = active = 0
    for key, spec in param_specs(config).items():
        if key.split(".")[0] in VISION_GROUPS:
            continue
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


def vision_flops(vision: VisionConfig, patches_per_image: list[int]) -> float:
    """FLOPs of the ViT's forward + backward over these images (module docstring formula)."""
    n = sum(patches_per_image)
    hv, m2 = vision.hidden_size, vision.spatial_merge_size**2
    per_patch = vision.patch_dim * hv + vision.depth * (
        4 * hv * hv + 2 * hv * vision.intermediate_size
    )
    attention = vision.depth * sum(4 * k * k * hv for k in patches_per_image)
    mergers = (1 + len(vision.deepstack_visual_indexes)) * (
        (m2 * hv) ** 2 + m2 * hv * vision.out_hidden_size
    )
    return 3 * (2 * n * per_patch + attention + 2 * (n // m2) * mergers)


def step_flops(bench: Bench, model: Qwen3MoeConfig, batch: Batch) -> float:
    """Model FLOPs of one step on ``batch``: the text formula plus the ViT's."""
    b, s = batch.tokens.shape
    flops = model_flops(model, b, s)
    if batch.image_grid_thw is not None and isinstance(model, Qwen3VLMoeConfig):
        grids = np.asarray(batch.image_grid_thw).reshape(-1, 3)
        flops += vision_flops(model.vision, [int(np.prod(g)) for g in grids if g[0] > 0])
    return flops


def screenshot_batch(
    config: Qwen3VLMoeConfig, processor: ImageProcessor, batch: int, seq: int, images: int
) -> Batch:
    """`random_batch` with ``images`` copies of the 1920x1080 desktop screenshot per row.

    Each image is ``<|vision_start|>`` + its pads + ``<|vision_end|>`` (loss mask 0), followed
    by an equal share of the row's random text; pixels and grids per row, M-RoPE positions.
    """
    pixels, grid = processor(SCREENSHOT.read_bytes())
    pads = int(np.prod(grid[0])) // config.vision.spatial_merge_size**2
    span = pads + 2
    text = (seq - 1 - images * span) // images
    if text < 1:
        raise SystemExit(f"--seq {seq}: {images} screenshots of {span} tokens do not fit")
    base = random_batch(config, batch, seq)
    tokens, loss_mask = base.tokens.copy(), base.loss_mask.copy()
    special = [config.image_token_id, config.video_token_id]
    special += [config.vision_start_token_id, config.vision_end_token_id]
    tokens[np.isin(tokens, special)] = 1  # random text holds no vision token
    for k in range(images):
        at = 1 + k * (span + text)
        tokens[:, at] = config.vision_start_token_id
        tokens[:, at + 1 : at + 1 + pads] = config.image_token_id
        tokens[:, at + 1 + pads] = config.vision_end_token_id
        loss_mask[:, at : at + span] = 0.0
    grids = np.broadcast_to(grid[0], (batch, images, 3)).astype(np.int32).copy()
    return base._replace(
        tokens=tokens,
        loss_mask=loss_mask,
        behavior_logprobs=np.where(loss_mask > 0, base.behavior_logprobs, 0.0).astype(np.float32),
        advantages=(base.advantages * loss_mask).astype(np.float32),
        positions=mrope_positions(tokens, grids, config),
        pixel_values=np.broadcast_to(
            np.tile(pixels, (images, 1)), (batch, images * len(pixels), pixels.shape[1])
        ).copy(),
        image_grid_thw=grids,
    )


def bench_batch(bench: Bench, model: Qwen3MoeConfig, b: int, s: int, images: int) -> Batch:
    """The benchmark's batch: random tokens, plus screenshots for a vision config."""
    if not isinstance(model, Qwen3VLMoeConfig) or not images:
        return random_batch(model, b, s)
    processor = ImageProcessor.from_dict(bench.preprocessor or QWEN3_VL_PREPROCESSOR)
    return screenshot_batch(model, processor, b, s, images)


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
    p.add_argument("--images", type=int, help="override the screenshots per row (vision configs)")
    p.add_argument("--seq", type=int, help="override S (tokens per row)")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--expert-backend", help="override ModelRuntimeConfig.expert_backend")
    p.add_argument("--remat", help="override ModelRuntimeConfig.remat")
    p.add_argument("--vision-remat", help="override ModelRuntimeConfig.vision_remat (the ViT)")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--no-replay", action="store_true", help="route live instead of R3")
    p.add_argument("--mesh", default="", help="data,fsdp,expert,tensor (default: all devices fsdp)")
    p.add_argument(
        "--preset",
        help="a mesh preset (configs/mesh_2gpu.gin, ...): its mesh, expert_parallel and overlap;"
        " the global batch is B x the devices the rows split over (unless --batch)",
    )
    p.add_argument(
        "--overlap",
        help="XLA overlap flags (trainer.overlap: none | pipelined | collective_matmul); "
        "overrides the preset's",
    )
    p.add_argument(
        "--no-expert-parallel",
        action="store_true",
        help="ModelRuntimeConfig.expert_parallel=False (experts gathered like FSDP parameters)",
    )
    p.add_argument("--peak-flops", type=float, default=790e12)
    p.add_argument("--attention", help="override ModelRuntimeConfig.attention (xla | cudnn)")
    p.add_argument(
        "--mesh-context",
        action="store_true",
        help="run the steps under jax.set_mesh(mesh) (Pallas expert kernels then shard_map)",
    )
    p.add_argument(
        "--hf-peers",
        default="",
        help="comma list of HF transformers peers to run first: eager,compile",
    )
    p.add_argument("--hf-child", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--peer-timeout", type=float, help="seconds each HF peer may take (then a failed row)"
    )
    p.add_argument("--no-ours", action="store_true", help="only the HF peers")
    p.add_argument(
        "--master-dtype",
        help="override TrainerConfig.master_dtype (float32 | bfloat16 | none = the policy dtype);"
        " the 04:43 H200 figures in benchmarks/NOTES.md predate float32 masters (bf16 params and"
        " bf16 AdamW state, like the HF peers)",
    )
    p.add_argument("--profile", help="after timing, trace one step into this dir (perfetto json)")
    p.add_argument(
        "--save-probs-bytes",
        type=int,
        help="override logprobs.DEFAULT_SAVE_BYTES (0: recompute the logits in the backward)",
    )
    p.add_argument("--unroll", action="store_true", help="scan_layers=False (unrolled layers)")
    p.add_argument("--print-steps", action="store_true", help="print every step's loss/grad norm")
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="compile the step and print XLA's memory analysis (no run)",
    )
    p.add_argument(
        "--host-batch",
        action="store_true",
        help="pass the numpy batch every step (upload + host checks inside the timing); by "
        "default the batch is put on the device once, as the HF peers' input ids are",
    )
    p.add_argument(
        "--gmm-config",
        help="JSON {triton, mosaic} of tuned Pallas grouped-matmul configs (benchmarks/moe_gemm.py"
        " --best-out) for the pallas_gmm / pallas_gmm_mosaic backends",
    )
    args = p.parse_args(argv)
    if args.hf_child:
        return _hf_child(args)
    peers = [_run_hf_peer(args, m) for m in args.hf_peers.split(",") if m]
    if args.no_ours:
        _print_table(peers)
        return None

    bench = CONFIGS[args.config]
    model = bench.model
    if args.layers:
        model = model.replace(num_hidden_layers=args.layers)
    runtime = bench.runtime
    if args.expert_backend:
        runtime = dataclasses.replace(runtime, expert_backend=args.expert_backend)
    if args.remat:
        runtime = dataclasses.replace(runtime, remat=args.remat)
    if args.vision_remat:
        runtime = dataclasses.replace(runtime, vision_remat=args.vision_remat)
    if args.unroll:
        runtime = dataclasses.replace(runtime, scan_layers=False)
    if args.save_probs_bytes is not None:
        from osworld_jax.trainer import logprobs

        logprobs.DEFAULT_SAVE_BYTES = args.save_probs_bytes
    if args.attention:
        runtime = dataclasses.replace(runtime, attention=args.attention)
    if args.gmm_config:
        from osworld_jax.model.kernels import grouped_matmul

        tuned = json.loads(open(args.gmm_config).read())
        grouped_matmul.configure(
            triton=grouped_matmul.config_from_dict(tuned["triton"]),
            mosaic=grouped_matmul.config_from_dict(tuned["mosaic"]),
        )
    b, s = args.batch or bench.batch, args.seq or bench.seq

    overlap = args.overlap
    if args.preset:  # before the backend starts: the overlap flags are read at start-up
        from mesh_presets import load_preset  # type: ignore[import-not-found]

        path = Path(args.preset)
        if not path.exists():
            path = Path(__file__).resolve().parents[1] / "configs" / args.preset
        axes, preset_runtime, preset_overlap = load_preset(path)
        overlap = overlap or preset_overlap
        runtime = dataclasses.replace(runtime, expert_parallel=preset_runtime.expert_parallel)
        if not args.batch:
            b = bench.batch * axes["data"] * axes["fsdp"] * axes["expert"]
        args.mesh = ",".join(str(axes[a]) for a in ("data", "fsdp", "expert", "tensor"))
    if overlap:
        from osworld_jax.trainer.overlap import apply_overlap

        print(f"overlap {overlap}: XLA_FLAGS={apply_overlap(overlap)}", flush=True)
    if args.no_expert_parallel:
        runtime = dataclasses.replace(runtime, expert_parallel=False)
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
    if args.master_dtype:
        config = dataclasses.replace(
            config, master_dtype=None if args.master_dtype == "none" else args.master_dtype
        )

    def init_fn() -> Policy:
        return Policy(model, runtime, rngs=nnx.Rngs(0))

    bounds = BatchBounds(num_owners=b, num_groups=1, norm_length=s)
    trainer = Trainer(config, nnx.eval_shape(init_fn), bounds=bounds, mesh=mesh)
    batch = bench_batch(bench, model, b, s, bench.images if args.images is None else args.images)
    host_batch = batch
    if args.memory_only:
        _memory_report(trainer, batch, args)
        return None
    t_init = time.perf_counter()
    state = trainer.init_state(init_fn=init_fn)
    jax.block_until_ready(state)
    print(f"init_state: {time.perf_counter() - t_init:.1f} s", flush=True)
    if not args.host_batch:
        batch = trainer._device_batch(batch)[0]  # checked and uploaded once, as every step would

    times = []
    ctx = jax.set_mesh(mesh) if args.mesh_context else contextlib.nullcontext()
    with ctx:
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            state, metrics = trainer.train_step(state, batch)  # host metrics: synced
            dt = time.perf_counter() - t0
            # Progress as it comes: a run cut short by its time limit still says how far it got.
            print(f"step {i}: {dt:.3f} s{' (compile + run)' if i == 0 else ''}", flush=True)
            if i >= args.warmup:
                times.append(dt)
            elif i == 0:
                compile_s = dt
            if args.print_steps:
                print(f"step {i}: loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.6f}")
        if args.profile:
            with jax.profiler.trace(args.profile, create_perfetto_trace=True):
                state, _ = trainer.train_step(state, batch)
                jax.block_until_ready(state)
    jax.block_until_ready(state)
    patches = 0 if host_batch.pixel_values is None else host_batch.pixel_values.shape[1]
    est = trainer.check_memory(b, s, capacity=float("inf"), patches=patches)
    print(f"estimate (osworld_jax.trainer.memory): {est.describe()}")
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices())

    total, active = active_params(model)
    step = statistics.median(times)
    flops = step_flops(bench, model, host_batch)
    images = (
        ""
        if host_batch.image_grid_thw is None
        else (
            f", {int((np.asarray(host_batch.image_grid_thw)[..., 0] > 0).sum())} screenshots of "
            f"{int(np.prod(host_batch.image_grid_thw[0, 0]))} patches"
        )
    )
    peak_all = args.peak_flops * mesh.devices.size  # MFU of the devices the step runs on
    rows = [
        (
            "config",
            f"{args.config} ({model.num_hidden_layers} layers, {runtime.expert_backend}, "
            f"{runtime.dtype}, remat={runtime.remat}, vision_remat={runtime.vision_remat})",
        ),
        (
            "devices",
            f"{jax.device_count()} x {jax.devices()[0].device_kind}, mesh {dict(mesh.shape)}",
        ),
        ("params (total / active)", f"{total / 1e6:,.3f}M / {active / 1e6:,.3f}M"),
        ("batch B x S", f"{b} x {s} = {b * s} tokens{images}"),
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
            f"MFU (peak {args.peak_flops / 1e12:.0f} TFLOP/s x {mesh.devices.size})",
            f"{flops / step / peak_all:.4%}",
        ),
        ("final loss / grad_norm", f"{metrics['loss']:.4f} / {metrics['grad_norm']:.4f}"),
        ("peak memory (max over devices)", f"{peak / 2**30:.1f} GiB"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    trainer.close()
    from osworld_jax.model.moe import auto_expert_backend
    from osworld_jax.trainer import logprobs

    backend = runtime.expert_backend
    ep = runtime.expert_parallel and mesh.shape.get("expert", 1) > 1
    if backend == "auto":
        backend = f"auto={auto_expert_backend(runtime.dtype)}"
    if ep:
        backend += f", expert-parallel {mesh.shape['expert']}"
    rows_per_device = b // trainer.data_parallel  # the logprob head decides per device
    save = logprobs.saves_probs(rows_per_device, s, model.vocab_size, runtime.dtype, None)
    name = (
        f"osworld_jax ({backend}, attn={runtime.attention}, remat={runtime.remat}"
        f"{'' if runtime.vision_remat is None else f' vision {runtime.vision_remat}'}, "
        f"{'scan' if runtime.scan_layers else 'unrolled'}, master={config.master_dtype}, "
        f"logprob bwd={'saved' if save else 'recompute'}, {jax.device_count()} dev)"
    )
    ours = dict(name=name, step_s=step, tokens=b * s, flops=flops, peak_gib=peak / 2**30)
    _print_table([*peers, ours], peak_flops=peak_all)
    return None


def _memory_report(trainer, batch, args) -> None:
    """Compiles the step on abstract state (no run) and prints XLA's memory analysis, in GiB."""
    fn, device_batch = trainer.jitted_step(batch)
    t0 = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        compiled = fn.lower(trainer.abstract_state, device_batch, None, None).compile()
    ma = compiled.memory_analysis()
    gib = {
        k: getattr(ma, f"{k}_size_in_bytes") / 2**30
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    peak = gib["argument"] + gib["output"] - gib["alias"] + gib["temp"]
    line = ", ".join(f"{k} {v:.2f}" for k, v in gib.items())
    patches = 0 if batch.pixel_values is None else batch.pixel_values.shape[1]
    est = trainer.check_memory(*batch.tokens.shape, capacity=float("inf"), patches=patches)
    print(f"ESTIMATE {est.describe()}", flush=True)
    print(
        f"MEMORY {args.config} master={trainer.config.master_dtype} "
        f"remat={args.remat} micro={args.micro_batches}: {line}; "
        f"args+out-alias+temp {peak:.2f} GiB (compile {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )


def _print_table(rows: list[dict], peak_flops: float = 790e12) -> None:
    """The side-by-side table: ms/step, tokens/s, MFU, peak memory."""
    print("\n| run | ms/step | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:120]} | | | |")
            continue
        mfu = r["flops"] / r["step_s"] / peak_flops
        print(
            f"| {r['name']} | {r['step_s'] * 1e3:.1f} | {r['tokens'] / r['step_s']:,.0f} | "
            f"{mfu:.1%} | {r['peak_gib']:.1f} |"
        )


def _run_hf_peer(args: argparse.Namespace, mode: str) -> dict:
    """Runs one HF peer in a subprocess (before this process initialises the GPU)."""
    cmd = [sys.executable, __file__, "--hf-child", mode, "--config", args.config]
    for flag in ("batch", "seq", "layers", "steps", "warmup", "images"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag}", str(value)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        sys.stdout.write(out[-3000:])
        return dict(name=f"HF {mode}", error=f"no result within --peer-timeout {e.timeout} s")
    sys.stdout.write(proc.stdout[-3000:])
    for line in proc.stdout.splitlines():
        if line.startswith("HF_RESULT "):
            return json.loads(line[len("HF_RESULT ") :])
    sys.stderr.write(proc.stderr[-4000:])
    return dict(name=f"HF {mode}", error=(proc.stderr.strip().splitlines() or ["?"])[-1])


def _hf_child(args: argparse.Namespace) -> None:
    """One HF transformers train step loop (see the module docstring), results as JSON."""
    import inspect

    import torch

    bench = CONFIGS[args.config]
    model_cfg = bench.model
    if args.layers:
        model_cfg = model_cfg.replace(num_hidden_layers=args.layers)
    b, s = args.batch or bench.batch, args.seq or bench.seq
    images = bench.images if args.images is None else args.images
    batch = bench_batch(bench, model_cfg, b, s, images)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke check of the peer
    vl = isinstance(model_cfg, Qwen3VLMoeConfig)
    if vl:
        from transformers import Qwen3VLMoeConfig as HFConfig
        from transformers import Qwen3VLMoeForConditionalGeneration as HFModel
    else:
        from transformers import Qwen3MoeConfig as HFConfig  # type: ignore[assignment]
        from transformers import Qwen3MoeForCausalLM as HFModel  # type: ignore[assignment]
    hf_cfg = HFConfig(**model_cfg.to_hf_dict())
    torch.manual_seed(0)
    with torch.device(device):
        model = HFModel._from_config(hf_cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    if hasattr(model, "set_experts_implementation") and device == "cuda":
        model.set_experts_implementation("grouped_mm")
    experts_impl = getattr(model.config, "_experts_implementation", "?")
    model.train()
    if args.hf_child == "compile":
        model.forward = torch.compile(model.forward)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, weight_decay=0.01, fused=device == "cuda")
    ids = torch.as_tensor(batch.tokens, dtype=torch.long, device=device)
    inputs = dict(input_ids=ids, labels=ids)
    if vl:  # the same pixels and grids (flat, HF's layout); no loss on the image spans
        labels = ids.masked_fill(torch.as_tensor(batch.loss_mask == 0, device=device), -100)
        inputs = dict(
            input_ids=ids,
            labels=labels,
            pixel_values=torch.as_tensor(
                batch.pixel_values.reshape(-1, batch.pixel_values.shape[-1]), device=device
            ),
            image_grid_thw=torch.as_tensor(batch.image_grid_thw.reshape(-1, 3), device=device),
        )
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kind = (batch.tokens == model_cfg.image_token_id).astype(np.int64)
            inputs["mm_token_type_ids"] = torch.as_tensor(kind, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step() -> float:
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    times = []
    for i in range(args.warmup + args.steps + (1 if args.hf_child == "compile" else 0)):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        if i >= args.warmup + (1 if args.hf_child == "compile" else 0):
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    result = dict(
        name=f"HF transformers {args.hf_child} (experts={experts_impl}, sdpa)",
        step_s=step_s,
        tokens=b * s,
        flops=step_flops(bench, model_cfg, batch),
        peak_gib=peak,
        loss=loss,
        times=times,
    )
    print("HF_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

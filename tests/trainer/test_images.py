"""The train step on screenshots: per-row images, M-RoPE positions, packing, micro-batches, R3.

A tiny random Qwen3-VL-MoE (3 LM layers, top-2 of 8 experts, a 3-block ViT with DeepStack) and
segments built the way the agent builds them (image placeholder runs sized by the processor,
PNG screenshots), packed by ``pack_batch`` with `VisionPacking`. The reference for every row is
the policy called on each segment alone with HF's flat image layout.
"""

from __future__ import annotations

import contextlib
import functools
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from osworld_jax.agent import GroupSelection, OwnerRollout, Segment, VisionPacking, pack_batch
from osworld_jax.batch import BatchBounds, with_pixel_values
from osworld_jax.model import (
    ImageProcessor,
    ModelRuntimeConfig,
    Policy,
    forward,
    make_mesh,
    mrope_positions,
)
from osworld_jax.model.tiny import tiny_config, tiny_vl_config
from osworld_jax.trainer import Trainer
from tests.trainer._tiny import trainer_config

IDS = {"<|vision_start|>": 120, "<|vision_end|>": 121, "<|image_pad|>": 122, "<|video_pad|>": 123}
CONFIG = tiny_vl_config(tiny_config(128, 1, moe_intermediate_size=48), IDS)
RUNTIME = ModelRuntimeConfig(dtype="float32", expert_backend="dense")
# Qwen3-VL's processor (patch 16, merge 2) with a CPU-sized pixel budget.
PROCESSOR = ImageProcessor(
    patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
)  # fmt: skip
VISION = VisionPacking(processor=PROCESSOR, config=CONFIG)
L, K = CONFIG.num_hidden_layers, CONFIG.num_experts_per_tok
BOUNDS = BatchBounds(num_owners=3, num_groups=1, norm_length=64)


def png(width: int, height: int, seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def segment(owner: int, sizes, seed: int, *, out: int = 6) -> Segment:
    """Text, then per image <vision_start> pad x n <vision_end> text, then ``out`` generated
    tokens (loss mask 1); behaviour logprobs are filled in later."""
    rng = np.random.default_rng(seed)
    images = tuple(png(w, h, seed * 10 + i) for i, (w, h) in enumerate(sizes))
    tokens = list(rng.integers(1, 100, 3))
    for w, h in sizes:
        n = PROCESSOR.num_image_tokens(h, w)
        tokens += [IDS["<|vision_start|>"], *[IDS["<|image_pad|>"]] * n, IDS["<|vision_end|>"]]
        tokens += list(rng.integers(1, 100, 2))
    tokens += list(rng.integers(1, 100, out))
    n = len(tokens)
    mask = np.zeros(n, np.float32)
    mask[n - out :] = 1.0
    return Segment(
        owner_id=owner,
        group_id=0,
        tokens=np.asarray(tokens, np.int32),
        loss_mask=mask,
        behavior_logprobs=np.zeros(n, np.float32),
        routed_experts=None,
        call_indices=(0,),
        weight_versions=("0",),
        images=images,
    )


def rollout(owner: int, segments) -> OwnerRollout:
    return OwnerRollout(
        owner_id=owner, group_id=0, segments=tuple(segments), reward=1.0, failed=False
    )


# Owner 0: two segments with images (one row with pack_segments); owner 1: two images of
# different sizes; owner 2: a text-only segment in the same batch.
SIZES = [[[(64, 48)], [(64, 48), (96, 64)]], [[(128, 96), (40, 40)]], [[]]]
SEGMENTS = [
    [segment(0, [(64, 48)], 1), segment(0, [(64, 48), (96, 64)], 2)],
    [segment(1, [(128, 96), (40, 40)], 3)],
    [segment(2, [], 4, out=9)],
]


@contextlib.contextmanager
def compile_counter():
    """Yields the list of the programs XLA compiles (or loads from a cache) in the block."""
    names: list[str] = []

    def listen(event: str, _secs: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def batch(**kw):
    sel = GroupSelection.of([rollout(i, s) for i, s in enumerate(SEGMENTS)])
    return pack_batch(sel, [0.5, -1.0, 0.25], num_layers=L, top_k=K, vision=VISION, **kw)


@pytest.fixture(scope="module")
def policy():
    return Policy(CONFIG, RUNTIME, rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(with_images, params, tokens, positions, pixels, grid):
    kw = dict(pixel_values=pixels, image_grid_thw=grid) if with_images else {}
    out = forward(params, CONFIG, RUNTIME, tokens, positions=positions, **kw)
    logp = jax.nn.log_softmax(out.logits[0], -1)
    lp = jnp.take_along_axis(logp[:-1], tokens[0, 1:, None], -1)[:, 0]
    return jnp.concatenate([jnp.zeros(1), lp]), out.routed_experts[0]


def alone(policy, seg: Segment, length: int = 256, patches: int = 256, slots: int = 2):
    """Logprobs [n] (aligned to tokens) and routes [n, L, K] of one segment in its own call, in
    HF's flat image layout (``pixel_values [N, P]``, ``image_grid_thw [n, 3]``), positions
    from ``mrope_positions``. The segment is padded at the end (causal: the padding changes no
    logprob before it) to one shape, so the reference compiles once."""
    n = seg.length
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :n] = seg.tokens
    pixels = np.zeros((patches, PROCESSOR.patch_dim), np.float32)
    grid = np.zeros((slots, 3), np.int32)
    if seg.images:
        p, g = PROCESSOR(list(seg.images))
        pixels[: p.shape[0]], grid[: g.shape[0]] = p, g
    positions = mrope_positions(tokens, grid[None], CONFIG)  # per-row grids: t = 0 unused
    lp, routes = _forward(bool(seg.images), policy.params(), tokens, positions, pixels, grid)
    return np.asarray(lp)[:n], np.asarray(routes)[:n]


def spans(b):
    """(row, start, segment) of every segment in a packed batch (in `SEGMENTS` order)."""
    out, flat = [], [s for segs in SEGMENTS for s in segs]
    for r in range(b.tokens.shape[0]):
        ids = b.segment_ids[r]
        for k in range(1, ids.max() + 1):
            out.append((r, int(np.argmax(ids == k))))
    return [(r, start, seg) for (r, start), seg in zip(out, flat, strict=True)]


def with_engine_replies(policy, b):
    """The batch as the engine would send it back: behaviour logprobs and routes of each
    segment computed alone (the rollout's own forward)."""
    behavior = np.zeros_like(b.behavior_logprobs)
    routes = np.full_like(b.routed_experts, -1)
    for r, start, seg in spans(b):
        lp, re_ = alone(policy, seg)
        n = seg.length
        behavior[r, start : start + n] = np.where(seg.loss_mask > 0, lp, 0.0)
        routes[r, start : start + n - 1] = re_[:-1]  # the last token was never an input
    return b._replace(behavior_logprobs=behavior.astype(np.float32), routed_experts=routes)


@pytest.mark.slow
def test_trainer_logprobs_equal_each_segment_alone(policy):
    # Rows holding one segment, and a row holding two segments with images (segment ids 1, 2):
    # every token's logprob equals that of its segment run alone (float32); the train step
    # reproduces every behaviour logprob and, image tokens replayed like text tokens, its route
    # agreement is exactly 1.
    trainer = Trainer(trainer_config(), policy, bounds=BOUNDS)
    state = trainer.init_state()
    for packed in (False, True):
        b = with_engine_replies(policy, batch(pack_segments=packed, length_buckets=[256]))
        assert b.tokens.shape[0] == (3 if packed else 4)
        # The host batch stores each screenshot once; the trainer makes the patches at upload.
        assert b.positions.shape == (3, *b.tokens.shape) and b.images is not None
        assert b.pixel_values is None
        lp = np.asarray(trainer.logprobs(state.params, b))
        dense = np.asarray(trainer.logprobs(state.params, with_pixel_values(b)))
        np.testing.assert_array_equal(lp, dense)  # the same pixels as the whole-batch patches
        for r, start, seg in spans(b):
            want, _ = alone(policy, seg)
            np.testing.assert_allclose(lp[r, start + 1 : start + seg.length], want[1:], atol=2e-6)
    assert b.segment_ids[0].max() == 2 and len(SEGMENTS[0][1].images) == 2
    state, metrics = trainer.train_step(state, b)
    assert metrics["route_agreement"] == 1.0
    assert metrics["logprob_abs_diff"] < 1e-6
    # The next step's rollouts: other screenshots and tokens, the same padded shape: the step
    # and the patch upload compile nothing again (each padded shape compiles once per run).
    other = [[segment(o, sizes, 50 + 7 * o + i, out=6 if sizes else 9)
              for i, sizes in enumerate(shapes)] for o, shapes in enumerate(SIZES)]  # fmt: skip
    sel = GroupSelection.of([rollout(i, s) for i, s in enumerate(other)])
    b2 = pack_batch(sel, [1.0, 0.5, -1.0], num_layers=L, top_k=K, vision=VISION,
                    pack_segments=True, length_buckets=[256])  # fmt: skip
    assert b2.tokens.shape == b.tokens.shape and b2.images.num_patches == b.images.num_patches
    assert b2.images.encoded != b.images.encoded
    with compile_counter() as compiled:
        state, metrics = trainer.train_step(state, b2)
    assert compiled == [] and metrics["step"] == 1


@pytest.mark.slow
def test_micro_batches_and_data_parallel_split_images_with_their_rows(policy):
    # 4 rows, 2 micro-batches x a 2-way data mesh: each micro-batch / shard gets its rows'
    # images; the gradients equal one micro-batch on one device.
    b = with_engine_replies(policy, batch(length_buckets=[256]))
    base = Trainer(trainer_config(), policy, bounds=BOUNDS)
    loss0, grads0 = base.gradients(base.init_state().params, b)
    split = Trainer(
        trainer_config(num_micro_batches=2),
        policy,
        bounds=BOUNDS,
        mesh=make_mesh(data=2, devices=jax.devices()[:2]),
    )
    loss1, grads1 = split.gradients(split.init_state().params, b)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-5)
    chex.assert_trees_all_close(jax.device_get(grads1), jax.device_get(grads0), atol=1e-6)
    assert np.abs(np.asarray(grads0["vision_blocks"]["qkv"])).max() > 0  # the ViT learns


def test_text_model_path_is_unchanged():
    # The text model keeps 1-D positions [R, T] (no M-RoPE, no pixels): a text batch packs as
    # before, and a batch with images is refused by a text model's trainer.
    from osworld_jax.trainer.state import TrainerError

    sel = GroupSelection.of([rollout(2, SEGMENTS[2])])
    text = pack_batch(sel, [1.0], num_layers=L, top_k=K)
    assert text.positions.shape == text.tokens.shape and text.pixel_values is None
    np.testing.assert_array_equal(text.positions[0], np.arange(text.tokens.shape[1]))
    text_policy = Policy(tiny_config(128, 1), RUNTIME, rngs=nnx.Rngs(0))
    trainer = Trainer(trainer_config(), text_policy, bounds=BOUNDS)
    with pytest.raises(TrainerError, match="text model"):
        trainer.train_step(trainer.init_state(), batch())


def test_device_patches_from_uint8_levels_equal_the_host_processors_bit_for_bit():
    """The trainer sends each device shard's uint8 patch levels and the processor's value table,
    and looks the float32 patches up on the device: the same values as the host processor's
    patches of the same PNGs (``with_pixel_values``), padding patches 0.0, a text-only row
    zeros, over 8 devices that split the rows; the levels are 1 / (4 T) of the patches' bytes."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from osworld_jax.trainer.images import device_pixel_values

    b = batch(dp_size=8)  # 3 rows with images, a text-only row, 4 padding rows: one per device
    images, dense = b.images, with_pixel_values(b).pixel_values
    levels, counts = images.levels()
    assert levels.dtype == np.uint8 and levels.nbytes * 4 * PROCESSOR.temporal_patch_size == (
        dense.nbytes
    )
    assert counts.tolist() == [int(np.prod(g, axis=-1).sum()) for g in b.image_grid_thw]
    assert 0 in counts.tolist() and np.all(dense[counts == 0] == 0.0)  # text-only / padding rows
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(8), ("data",))
    on_device = device_pixel_values(images, NamedSharding(mesh, PartitionSpec("data")))
    assert on_device.sharding.shard_shape(on_device.shape)[0] == dense.shape[0] // 8
    np.testing.assert_array_equal(np.asarray(on_device), dense)
    # and each image alone through the processor (the server's path): the same values
    first = np.concatenate([PROCESSOR(png)[0] for png in SEGMENTS[1][0].images])
    row = next(r for r in range(len(counts)) if b.owner_ids[r] == 1 and counts[r])
    np.testing.assert_array_equal(np.asarray(on_device[row, : first.shape[0]]), first)

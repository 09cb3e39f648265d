"""Screenshot -> patches: the cost of `ImageProcessor` per image on CPU (the agent room's hot path).

For each case: the patch grid, the LM image tokens, and the best wall time over ``--reps`` calls
(the least disturbed by other load) of ours and of transformers' ``Qwen2VLImageProcessorPil``
(the reference we are bit-equal to), PNG decoding included for the screenshot (``bytes`` in, as
a sandbox observation gives). Then the trainer's upload (``trainer/images.py``): the host's
part (``levels``: decode, resize, patch order in uint8) and the value lookup on the device
(``patches_from_levels``, jitted; on this machine the "device" is the CPU), and the bytes sent
(uint8 levels against the float32 patches the host made before).

Usage::

    python benchmarks/image_processor.py [--reps 10] [--upload-rows 4]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osworld_jax.model.processor import QWEN3_VL_PREPROCESSOR, ImageProcessor  # noqa: E402

SCREENSHOT = Path(__file__).resolve().parents[1] / "tests/model/assets/desktop_1920x1080.png"


def _best_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--upload-rows", type=int, default=4, help="0: no upload measurement")
    parser.add_argument(
        "--step-only", action="store_true", help="only the server's image work of one RL step"
    )
    args = parser.parse_args()
    if args.step_only:
        rollout_step()
        return
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    small = {**QWEN3_VL_PREPROCESSOR, "size": {"shortest_edge": 64 * 64, "longest_edge": 384**2}}
    shot = SCREENSHOT.read_bytes()
    rng = np.random.RandomState(0)
    cases = [
        ("1920x1080 PNG, Qwen3-VL budget", QWEN3_VL_PREPROCESSOR, shot),
        ("1920x1080 PNG, tiny budget (384^2)", small, shot),
        (
            "1280x720 noise, Qwen3-VL budget",
            QWEN3_VL_PREPROCESSOR,
            rng.randint(0, 256, (720, 1280, 3), dtype=np.uint8),
        ),
    ]
    import jax

    from osworld_jax.model.pixels import patches_from_levels

    print(
        f"| {'case':<36} | {'grid':>11} | {'tokens':>6} | {'ours ms':>8} | {'HF PIL ms':>9} "
        f"| {'levels ms':>9} | {'lookup ms':>9} | {'MiB f32 -> u8':>13} |"
    )
    print(
        f"|{'-' * 38}|{'-' * 13}|{'-' * 8}|{'-' * 10}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 15}|"
    )
    for name, config, image in cases:
        ours = ImageProcessor.from_dict(config)
        skip = ("processor_class", "image_processor_type")
        ref = Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k not in skip})
        _, grid = ours(image)
        t, h, w = grid[0]

        def hf(image=image, ref=ref):
            pil = Image.open(io.BytesIO(image)) if isinstance(image, bytes) else image
            return ref(images=[pil], return_tensors="np")

        ms_ours = _best_ms(lambda image=image, ours=ours: ours(image), args.reps)
        ms_ref = _best_ms(hf, args.reps)
        ms_levels = _best_ms(lambda image=image, ours=ours: ours.levels(image), args.reps)
        levels = ours.levels(image)[0][None]  # u8[1, N, 3, P * P]: one row
        dev = [jax.device_put(x) for x in (levels, np.asarray([levels.shape[1]], np.int32))]
        table = jax.device_put(ours.value_table())
        frames = ours.temporal_patch_size

        def lookup(dev=dev, table=table, frames=frames):
            return jax.block_until_ready(patches_from_levels(*dev, table, frames=frames))

        lookup()  # compile
        ms_lookup = _best_ms(lookup, args.reps)
        f32, u8 = levels.size * frames * 4 / 2**20, levels.nbytes / 2**20
        tokens = ours.num_image_tokens(
            *(
                Image.open(io.BytesIO(image)).size[::-1]
                if isinstance(image, bytes)
                else image.shape[:2]
            )
        )
        print(
            f"| {name:<36} | {f'{t}x{h}x{w}':>11} | {tokens:>6} | {ms_ours:8.1f} | {ms_ref:9.1f} "
            f"| {ms_levels:9.1f} | {ms_lookup:9.1f} | {f'{f32:.1f} -> {u8:.1f}':>13} |"
        )
    if args.upload_rows:
        upload(args.upload_rows, 3, max(1, args.reps // 3))
    rollout_step()


def rollout_step(tasks: int = 2, owners: int = 4, turns: int = 3, in_context: int = 3) -> None:
    """The embedded server's image work in one RL step of configs/gpu_1x_h100.gin's pattern.

    ``tasks`` x ``owners`` owners (the owners of a task forked from one start: the same first
    screenshot), ``turns`` turns each; every turn's request carries the last ``in_context``
    screenshots (1920x1080 PNG, Qwen3-VL budget), and the server reads, checks, decodes and
    patchifies them (`server.images.load_request_images`, the body path), without and with the
    processed-image cache (`ProcessedImageCache`). A turn's requests hold their patches until the
    turn ends (the server keeps them until each request is prefilled); one core, in order.
    """
    import base64

    base = Image.open(SCREENSHOT).convert("RGB")

    def shot(seed: int) -> str:
        img = base.copy()
        img.paste((37 * seed % 256, 90, 160), (100 + 13 * seed, 200, 400 + 13 * seed, 500))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    # episode (task, owner): screenshot k is the task's start for k = 0, the owner's own after
    start = {t: shot(1000 + t) for t in range(tasks)}
    shots = {
        (t, o, k): start[t] if k == 0 else shot(100 * t + 10 * o + k)
        for t in range(tasks)
        for o in range(owners)
        for k in range(turns)
    }
    rounds = [  # each turn's requests, sent together
        [
            [shots[t, o, j] for j in range(max(0, k + 1 - in_context), k + 1)]
            for t in range(tasks)
            for o in range(owners)
        ]
        for k in range(turns)
    ]
    requests = [r for turn in rounds for r in turn]
    sent = sum(map(len, requests))
    distinct = len(set(shots.values()))

    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # each case in a fresh process: a fresh heap
    with ctx.Pool(1) as pool:
        plain, _ = pool.apply(_step_seconds, (rounds, False))
    with ctx.Pool(1) as pool:
        cached, (hits, misses) = pool.apply(_step_seconds, (rounds, True))
    print(
        f"\nThe server's image work of one RL step ({tasks} tasks x {owners} owners x {turns} "
        f"turns, the last {in_context} screenshots per request: {len(requests)} requests, "
        f"{sent} screenshots sent, {distinct} distinct; one core):"
    )
    print("| server | decoded + patchified | seconds |")
    print("|---|---|---|")
    print(f"| no cache | {sent} | {plain:.2f} |")
    print(f"| processed-image cache | {misses} ({hits} hits) | {cached:.2f} |")


def upload(rows: int, per_row: int, reps: int) -> None:
    """One device shard's rows as the trainer uploads them: before (float32 patches made on the
    host, then copied) and now (uint8 levels on the host, value lookup on the device)."""
    import jax

    from osworld_jax.batch import RowImages
    from osworld_jax.trainer.images import device_pixel_values

    processor = ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR)
    base = Image.open(SCREENSHOT).convert("RGB")
    shots = []
    for i in range(rows + per_row - 1):  # a sliding window: row r shows shots r .. r + m - 1
        img = base.copy()
        img.paste((40 * i % 256, 90, 160), (100 + 30 * i, 200, 400 + 30 * i, 500))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        shots.append(buf.getvalue())
    grid = processor.levels(shots[0])[1]
    index = np.asarray([[r + k for k in range(per_row)] for r in range(rows)], np.int32)
    images = RowImages(
        encoded=tuple(shots),
        grid_thw=np.repeat(grid, len(shots), axis=0),
        index=index,
        num_patches=per_row * int(np.prod(grid)),
        processor=processor,
    )
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def before():
        return jax.block_until_ready(jax.device_put(images.pixel_values(), jax.devices()[0]))

    def now():
        return jax.block_until_ready(device_pixel_values(images, sharding))

    assert np.array_equal(np.asarray(before()), np.asarray(now()))
    ms_before, ms_now = _best_ms(before, reps), _best_ms(now, reps)
    f32 = rows * images.num_patches * processor.patch_dim * 4 / 2**30
    print(
        f"\nUpload of {rows} rows x {per_row} screenshots (1920x1080, Qwen3-VL budget, "
        f"{len(shots)} distinct): before {ms_before / 1e3:.2f} s ({f32:.2f} GiB float32 on the "
        f"host), now {ms_now / 1e3:.2f} s ({f32 / 4 / processor.temporal_patch_size:.2f} GiB "
        "uint8 sent); equal bit for bit"
    )


def _step_seconds(rounds: list, cached: bool) -> tuple[float, tuple[int, int]]:
    """Seconds to read and process every turn's requests (`rollout_step`), and (hits, misses)."""
    from osworld_jax.server.image_memory import ProcessedImageCache
    from osworld_jax.server.images import ImageLimits, load_request_images

    processor = ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR)
    cache = ProcessedImageCache(2048 << 20) if cached else None
    t0 = time.perf_counter()
    for turn in rounds:  # a turn's requests hold their patches until they are prefilled
        held = [
            load_request_images(items, "request", processor, ImageLimits(), 1 << 20, cache)
            for items in turn
        ]
        del held
    seconds = time.perf_counter() - t0
    return seconds, (cache.hits, cache.misses) if cache is not None else (0, 0)


if __name__ == "__main__":
    main()

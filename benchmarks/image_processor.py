"""Screenshot -> patches: the cost of `ImageProcessor` per image on CPU (the agent room's hot path).

For each case: the patch grid, the LM image tokens, and the best wall time over ``--reps`` calls
(the least disturbed by other load) of ours and of transformers' ``Qwen2VLImageProcessorPil``
(the reference we are bit-equal to), PNG decoding included for the screenshot (``bytes`` in, as
a sandbox observation gives).

Usage::

    python benchmarks/image_processor.py [--reps 10]
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
    args = parser.parse_args()
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
    print(f"| {'case':<36} | {'grid':>11} | {'tokens':>6} | {'ours ms':>8} | {'HF PIL ms':>9} |")
    print(f"|{'-' * 38}|{'-' * 13}|{'-' * 8}|{'-' * 10}|{'-' * 11}|")
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
        tokens = ours.num_image_tokens(
            *(
                Image.open(io.BytesIO(image)).size[::-1]
                if isinstance(image, bytes)
                else image.shape[:2]
            )
        )
        print(
            f"| {name:<36} | {f'{t}x{h}x{w}':>11} | {tokens:>6} | {ms_ours:8.1f} | {ms_ref:9.1f} |"
        )


if __name__ == "__main__":
    main()

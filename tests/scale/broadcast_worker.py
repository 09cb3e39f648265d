"""One process of a 2-process job that broadcasts a host batch with stored screenshots.

``python tests/scale/broadcast_worker.py COORDINATOR PROCESS_ID CHUNK_BYTES`` joins a 2-process
job (1 CPU device each, gloo); process 0 packs nothing itself but builds `batch()` (rows showing
two PNGs, one of them in three rows; a -0.0 and a NaN among the behaviour logprobs) and
`broadcast_host_batch` sends it in chunks of ``CHUNK_BYTES``. Each process prints
``digest <sha256 of every array, the encoded images and the processor>``, ``pixels <sha256 of
the patches made from the received images>`` and (process 1) ``collectives <n> largest <bytes>``.
"""

import hashlib
import io
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.xla_env import use_host_devices  # noqa: E402

use_host_devices(1)

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from osworld_jax.batch import Batch, RowImages, to_arrays, with_pixel_values  # noqa: E402
from osworld_jax.model import ImageProcessor  # noqa: E402

PROCESSOR = ImageProcessor(min_pixels=32 * 32, max_pixels=64 * 64)


def png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def batch() -> Batch:
    """4 rows x 16 tokens; images a (64x64: 16 patches) in rows 0-2, b (32x64) in row 1."""
    r, t = 4, 16
    a, b = png(0, (64, 64)), png(1, (64, 32))
    index = np.array([[0, -1], [0, 1], [0, -1], [-1, -1]], np.int32)
    grids = {0: PROCESSOR.grid_thw(64, 64), 1: PROCESSOR.grid_thw(32, 64)}
    grid = np.zeros((r, 2, 3), np.int32)
    for (row, k), i in np.ndenumerate(index):
        if i >= 0:
            grid[row, k] = grids[i]
    behavior = np.random.default_rng(2).normal(size=(r, t)).astype(np.float32)
    behavior[0, 0], behavior[0, 1] = -0.0, np.nan
    return Batch(
        tokens=np.arange(r * t, dtype=np.int32).reshape(r, t),
        loss_mask=np.ones((r, t), np.float32),
        behavior_logprobs=behavior,
        advantages=np.full((r, t), 0.5, np.float32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (3, r, t)).copy(),
        segment_ids=np.ones((r, t), np.int32),
        owner_ids=np.arange(r, dtype=np.int32),
        group_ids=np.zeros(r, np.int32),
        row_weight=np.ones(r, np.float32),
        routed_experts=np.random.default_rng(3).integers(0, 8, (r, t, 2, 2)).astype(np.int32),
        image_grid_thw=grid,
        images=RowImages(
            encoded=(a, b),
            grid_thw=np.array([grids[0], grids[1]], np.int32),
            index=index,
            num_patches=32,
            processor=PROCESSOR,
        ),
    )


def digest(b: Batch) -> str:
    h = hashlib.sha256()
    for name, a in sorted(to_arrays(b).items()):
        h.update(f"{name}{a.dtype.str}{a.shape}".encode() + np.ascontiguousarray(a).tobytes())
    assert b.images is not None
    h.update(repr(b.images.processor).encode())
    return h.hexdigest()


def main() -> None:
    coordinator, pid, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from osworld_jax.trainer import distributed
    from osworld_jax.trainer.distributed import broadcast_host_batch
    from tests.scale.pair import init_pair

    init_pair(coordinator, pid, collective_timeout_s=60, broadcast_chunk_bytes=chunk)
    sizes = []
    broadcast = distributed.multihost_utils.broadcast_one_to_all

    def counted(tree, *args, **kwargs):
        sizes.append(sum(np.asarray(x).nbytes for x in __import__("jax").tree.leaves(tree)))
        return broadcast(tree, *args, **kwargs)

    distributed.multihost_utils.broadcast_one_to_all = counted
    out = broadcast_host_batch(batch() if pid == 0 else None)
    print("digest", digest(out))
    print("pixels", hashlib.sha256(with_pixel_values(out).pixel_values.tobytes()).hexdigest())
    print("collectives", len(sizes), "largest", max(sizes), flush=True)


if __name__ == "__main__":
    main()

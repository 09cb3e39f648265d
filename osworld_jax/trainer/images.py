"""The trainer's image inputs: the device ``pixel_values`` made from a batch's stored images.

The host step batch holds each distinct screenshot once as its encoded bytes (`RowImages`);
at upload the host makes uint8 patch levels per device shard of rows and the device looks the
processor's float32 values up, bit for bit the processor's patches (docs/INTERFACES.md, Batch).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from osworld_jax.batch import RowImages
from osworld_jax.model.pixels import patches_from_levels


def device_pixel_values(images: RowImages, sharding: jax.sharding.Sharding) -> jax.Array:
    """``pixel_values`` f32[R, Np, P] laid out as ``sharding``, made from the stored images.

    The host makes the uint8 patch levels of one device shard of rows at a time (decode,
    resize and patch order: `RowImages.levels`), sends them with the processor's value table,
    and the device looks the float32 values up (`patches_from_levels`: bit for bit the host
    processor's patches). A 1920x1080 screenshot at Qwen3-VL's limits is 6.0 MiB of levels
    instead of 47.8 MiB of float32 patches, and the host never writes the float32 values
    (which cost ~2 s per screenshot on a loaded core). Each row range is made once, copied to
    the devices that hold it, then dropped; each process makes only its own rows.
    """
    rows = images.index.shape[0]
    shape = (rows, images.num_patches, images.processor.patch_dim)
    ranges: dict[tuple[int, int], list[Any]] = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        ranges[(index or (slice(None),))[0].indices(rows)[:2]].append(device)
    table = images.processor.value_table()  # f32[C, 256]
    frames = images.processor.temporal_patch_size
    shards = []
    for (start, stop), devices in ranges.items():
        levels, counts = images.levels(np.arange(start, stop))  # u8[n, Np, C, PP], i32[n]
        for d in devices:
            on = [jax.device_put(x, d) for x in (levels, counts, table)]
            shards.append(patches_from_levels(*on, frames=frames))
        jax.block_until_ready(shards[-len(devices) :])  # then the next range's host levels
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)

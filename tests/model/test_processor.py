"""The image processor equals transformers' Qwen2-VL processor (its Pillow backend) exactly.

The reference is ``Qwen2VLImageProcessorPil`` of the installed transformers: the same algorithm
Qwen3-VL's ``preprocessor_config.json`` names, on Pillow (its torchvision backend needs a
torchvision matching the CPU torch, which PyPI does not ship). ``assets/desktop_1920x1080.png``
is a screenshot of the local sandbox (a mousepad window on the Xvfb desktop), taken with
``LocalBackend`` exactly as ``test_live_local_sandbox_screenshot`` does.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from osworld_jax.model import ImageInputError, ImageProcessor, ModelConfigError, smart_resize
from osworld_jax.model.processor import QWEN3_VL_PREPROCESSOR

ASSETS = Path(__file__).parent / "assets"
SCREENSHOT = ASSETS / "desktop_1920x1080.png"


def _hf(config: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    kwargs = {
        k: v for k, v in config.items() if k not in ("processor_class", "image_processor_type")
    }
    return Qwen2VLImageProcessorPil(**kwargs)


def _assert_same(ours: ImageProcessor, ref, images, ref_images=None) -> None:
    pixel_values, grid = ours(images)
    out = ref(images=ref_images if ref_images is not None else images, return_tensors="np")
    np.testing.assert_array_equal(grid, out["image_grid_thw"])
    assert grid.dtype == np.int32 and pixel_values.dtype == np.float32
    # Same Pillow bicubic, same float32 arithmetic: bit-identical, not merely close.
    np.testing.assert_array_equal(pixel_values, out["pixel_values"])


def _odd_images() -> list:
    rng = np.random.RandomState(0)
    rgba = rng.randint(0, 256, (300, 17, 4), dtype=np.uint8)
    palette = Image.fromarray(rng.randint(0, 256, (31, 45), dtype=np.uint8), "L").convert("P")
    palette.info["transparency"] = 7
    return [
        rng.randint(0, 256, (37, 53, 3), dtype=np.uint8),  # tiny: scaled up to min_pixels
        Image.fromarray(rng.randint(0, 256, (13, 200, 3), dtype=np.uint8)),  # wide, odd
        Image.fromarray(rgba, "RGBA"),  # tall with alpha (composited onto white)
        rgba,  # the same as an array (HF's numpy compositing)
        Image.fromarray(rng.randint(0, 256, (65, 33), dtype=np.uint8), "L"),  # grayscale
        palette,  # palette with a transparent index
        rng.randint(0, 256, (3000, 2501, 3), dtype=np.uint8),  # above max_pixels: scaled down
    ]


def test_real_screenshot_matches_hf_qwen3_vl_processor():
    shot = SCREENSHOT.read_bytes()
    ours = ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR)
    ref = _hf(QWEN3_VL_PREPROCESSOR)
    with Image.open(io.BytesIO(shot)) as im:
        assert im.size == (1920, 1080)
        _assert_same(ours, ref, [shot], [im.copy()])
    pixel_values, grid = ours(shot)
    # 1080 -> round(1080 / 32) * 32 = 1088 rows, 1920 columns: a 68 x 120 patch grid.
    assert grid.tolist() == [[1, 68, 120]] and pixel_values.shape == (68 * 120, 3 * 2 * 16 * 16)
    assert ours.num_image_tokens(1080, 1920) == 68 * 120 // 4 == 2040


def test_odd_sizes_and_modes_match_hf():
    config = {
        **QWEN3_VL_PREPROCESSOR,
        "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 2**20},
    }
    images = _odd_images()
    _assert_same(ImageProcessor.from_dict(config), _hf(config), images)
    # Qwen2-VL's own defaults (patch 14, CLIP mean/std), and a JPEG given as bytes.
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(1).randint(0, 256, (99, 161, 3), dtype=np.uint8)).save(
        buf, "JPEG", quality=90
    )
    with Image.open(io.BytesIO(buf.getvalue())) as decoded:
        _assert_same(ImageProcessor(), _hf({}), [buf.getvalue()], [decoded.copy()])


def test_live_local_sandbox_screenshot(tmp_path):
    """A screenshot the local sandbox takes right now (Xvfb 1920x1080) processes like HF."""
    import asyncio

    from osworld_jax.env.local import LocalBackend, LocalBackendConfig
    from osworld_jax.env.tasks import load_task

    task = load_task(
        {
            "id": "vision-processor-shot",
            "snapshot": "test",
            "instruction": "Look at the desktop.",
            "source": "tests",
            "config": [],
            "evaluator": {"func": "infeasible"},
        }
    )

    async def shoot() -> bytes:
        backend = LocalBackend(LocalBackendConfig())
        backend.preflight()
        try:
            sandbox = await backend.create(task)
            try:
                obs = await sandbox.observe()
            finally:
                await sandbox.close()
        finally:
            await backend.aclose()
        assert obs.screenshot is not None
        return obs.screenshot

    shot = asyncio.run(shoot())
    with Image.open(io.BytesIO(shot)) as im:
        assert im.size == (1920, 1080)
        _assert_same(
            ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR),
            _hf(QWEN3_VL_PREPROCESSOR),
            [shot],
            [im.copy()],
        )


@pytest.mark.parametrize(
    "hw, expect",
    [
        ((1080, 1920), (1088, 1920)),  # round(33.75) = 34 rows of 32
        ((16, 16), (256, 256)),  # below min_pixels 65536: beta = 16, ceil to 32s
        ((4000, 6000), (3328, 4992)),  # above 2^24: beta = sqrt(24e6 / 2^24), floor to 32s
        # round(1.5) = 2 and round(2.5) = 2 (half to even): 64 x 64 < min, so
        # beta = sqrt(65536 / 3840) = 4.131: ceil(6.20) = 7 and ceil(10.33) = 11 blocks of 32.
        ((48, 80), (224, 352)),
    ],
)
def test_smart_resize_hand_derived(hw, expect):
    got = smart_resize(*hw, factor=32, min_pixels=65536, max_pixels=16777216)
    assert got == expect
    assert got[0] % 32 == 0 and got[1] % 32 == 0 and 65536 <= got[0] * got[1] <= 16777216


def test_smart_resize_rejects_degenerate_sizes():
    with pytest.raises(ImageInputError, match="aspect ratio"):
        smart_resize(10, 2010, factor=32, min_pixels=1, max_pixels=2**30)
    with pytest.raises(ImageInputError, match="> 0"):
        smart_resize(0, 10, factor=32, min_pixels=1, max_pixels=2**30)


def test_from_pretrained_reads_size_and_legacy_keys(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR))
    p = ImageProcessor.from_pretrained(tmp_path)
    assert (p.patch_size, p.merge_size, p.temporal_patch_size) == (16, 2, 2)
    assert (p.min_pixels, p.max_pixels) == (65536, 16777216)
    assert p.image_mean == (0.5, 0.5, 0.5) and p.image_std == (0.5, 0.5, 0.5)
    # Legacy top-level min_pixels / max_pixels override size (as HF's __init__ does).
    legacy = {**QWEN3_VL_PREPROCESSOR, "min_pixels": 3136, "max_pixels": 12845056}
    q = ImageProcessor.from_dict(legacy)
    assert (q.min_pixels, q.max_pixels) == (3136, 12845056)
    # to_dict / save_pretrained round trip, and HF reads what we write.
    (tmp_path / "out").mkdir()
    p.save_pretrained(tmp_path / "out")
    assert ImageProcessor.from_pretrained(tmp_path / "out") == p
    ref = _hf(json.loads((tmp_path / "out" / "preprocessor_config.json").read_text()))
    _assert_same(p, ref, _odd_images()[:2])


def test_config_errors_name_the_file(tmp_path):
    with pytest.raises(ModelConfigError, match="no such preprocessor config"):
        ImageProcessor.from_pretrained(tmp_path)
    bad = tmp_path / "preprocessor_config.json"
    bad.write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(ModelConfigError, match=r"preprocessor_config.json.*CLIPImageProcessor"):
        ImageProcessor.from_pretrained(tmp_path)
    bad.write_text(json.dumps({"size": {"shortest_edge": 10, "longest_edge": 5}}))
    with pytest.raises(ModelConfigError, match="min_pixels"):
        ImageProcessor.from_pretrained(tmp_path)


def test_bad_images_raise_one_clear_error():
    p = ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR)
    with pytest.raises(ImageInputError, match="image 1: not a decodable image"):
        p([SCREENSHOT.read_bytes(), b"\x89PNG garbage"])
    with pytest.raises(ImageInputError, match="image 0: array dtype float32"):
        p(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(ImageInputError, match=r"image 0: array shape \(8, 8, 2\)"):
        p(np.zeros((8, 8, 2), np.uint8))
    with pytest.raises(ImageInputError, match="image 0: image size 1x300: aspect ratio"):
        p(np.zeros((300, 1, 3), np.uint8))


def test_token_counts_agree_with_processed_patches():
    p = ImageProcessor.from_dict(QWEN3_VL_PREPROCESSOR)
    for image in _odd_images()[:3]:
        h, w = image.shape[:2] if isinstance(image, np.ndarray) else image.size[::-1]
        pixel_values, grid = p(image)
        assert tuple(grid[0]) == p.grid_thw(h, w)
        assert pixel_values.shape[0] == grid[0].prod() == 4 * p.num_image_tokens(h, w)
    empty, grid = p([])
    assert empty.shape == (0, p.patch_dim) and grid.shape == (0, 3)


def test_processor_and_mrope_import_no_jax():
    """The agent room (jax-free) imports the processor through the package."""
    code = (
        "import sys; import osworld_jax.model.processor; "
        "from osworld_jax.model import ImageProcessor, mrope_positions, Qwen3VLMoeConfig; "
        "assert 'jax' not in sys.modules, 'jax imported'; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

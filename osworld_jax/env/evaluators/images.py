"""Image metrics (GIMP tasks and screenshots) with Pillow, NumPy and scikit-image's SSIM.

Follows upstream ``desktop_env/evaluators/metrics/gimp.py`` and ``compare_images`` of
``vlc.py``. "Same structure" is SSIM (scikit-image, 7-pixel window, over RGB channels) at least
a threshold (0.9 by default) on images of equal size, or a mean squared error below 0.03 of
[0, 1] pixel values after brightness normalisation. A ``None`` image (file missing) scores 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageChops, ImageStat

from osworld_jax.env.evaluators.registry import METRICS


def _ssim(a: np.ndarray, b: np.ndarray, **kw: Any) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, **kw))


def _win(arr: np.ndarray) -> int | None:
    """The SSIM window: 7, or the largest odd size that fits a smaller image (None: none)."""
    d = min(arr.shape[0], arr.shape[1])
    if d >= 7:
        return 7
    w = d if d % 2 == 1 else d - 1
    return w if w >= 1 else None


def same_structure_ssim(img1: Image.Image, img2: Image.Image, threshold: float = 0.9) -> bool:
    """SSIM of the two RGB images >= ``threshold`` (False for sizes below 7 px or unequal)."""
    if min(img1.width, img1.height, img2.width, img2.height) < 7:
        return False
    img1 = img1 if img1.mode == "RGB" else img1.convert("RGB")
    img2 = img2 if img2.mode == "RGB" else img2.convert("RGB")
    if img1.size != img2.size:
        return False
    a, b = np.array(img1), np.array(img2)
    win = _win(a)
    if win is None:
        return False
    try:
        return _ssim(a, b, win_size=win, channel_axis=2) >= threshold
    except ValueError:
        return False


def same_structure_mse(img1: Image.Image, img2: Image.Image, threshold: float = 0.03) -> bool:
    """Mean squared error of [0, 1] RGB pixels < ``threshold`` (img1 resized to img2 first)."""
    if img1.size != img2.size:
        img1 = img1.resize(img2.size, Image.Resampling.LANCZOS)
    a = np.array(img1.convert("RGB"), dtype=np.float32) / 255
    b = np.array(img2.convert("RGB"), dtype=np.float32) / 255
    return bool(np.mean((a - b) ** 2) < threshold)


def _brightness(img: Image.Image) -> float:
    return float(ImageStat.Stat(img.convert("L")).mean[0])


def _normalize_brightness(img: Image.Image, target: float) -> Image.Image:
    factor = target / _brightness(img)
    return img.point(lambda x: min(255, max(0, int(x * factor))))


def _open(path: str) -> Image.Image:
    return Image.open(path)


@METRICS.register("compare_images")
def compare_images(image1: str | None, image2: str | None, **options: Any) -> float:
    """SSIM of the two images in greyscale, both resized to the smaller size (lexicographic).

    With ``reference_base_result`` b the score is ``(s - b) / (1 - b)`` when ``s >= b + 0.01``,
    else 0.
    """
    if not image1 or not image2:
        return 0.0
    a, b = _open(image1).convert("L"), _open(image2).convert("L")
    size = min(a.size, b.size)
    a = a.resize(size, Image.Resampling.LANCZOS)
    b = b.resize(size, Image.Resampling.LANCZOS)
    s = _ssim(np.array(a), np.array(b))
    base = options.get("reference_base_result")
    if base is None:
        return s
    return (s - base) / (1 - base) if s >= base + 0.01 else 0.0


@METRICS.register("compare_image_list")
def compare_image_list(pred: Any, gold: Any) -> float:
    """1 iff each predicted image equals its gold image pixel for pixel (resized to it first)."""
    if not isinstance(pred, list):
        pred, gold = [pred], [gold]
    for p, g in zip(pred, gold, strict=False):
        if not p or not g:
            return 0.0
        a, b = _open(p), _open(g)
        if a.size != b.size:
            a = a.resize(b.size, Image.Resampling.LANCZOS)
        if a.mode != b.mode:
            a = a.convert(b.mode)
        if ImageChops.difference(a, b).getbbox():
            return 0.0
    return 1.0


@METRICS.register("check_brightness_decrease_and_structure_sim")
def check_brightness_decrease_and_structure_sim(
    src: str | None, tgt: str | None, threshold: float = 0.03
) -> float:
    """1 iff ``src`` is darker than ``tgt`` and alike after normalising both to brightness 128."""
    if src is None or tgt is None:
        return 0.0
    a, b = _open(src), _open(tgt)
    darker = _brightness(b) > _brightness(a)
    same = same_structure_mse(
        _normalize_brightness(a, 128), _normalize_brightness(b, 128), threshold
    )
    return float(darker and same)


def _mean_saturation(img: Image.Image) -> float:
    return float(np.mean(np.array(img.split()[1])))


@METRICS.register("check_saturation_increase_and_structure_sim")
def check_saturation_increase_and_structure_sim(src: str | None, tgt: str | None) -> float:
    """1 iff ``src`` is more saturated than ``tgt`` with the same hue and value structure."""
    if src is None or tgt is None:
        return 0.0
    a, b = _open(src).convert("HSV"), _open(tgt).convert("HSV")
    more = _mean_saturation(b) < _mean_saturation(a)
    h1, _, v1 = a.split()
    h2, _, v2 = b.split()
    return float(more and same_structure_ssim(h1, h2) and same_structure_ssim(v1, v2))


@METRICS.register("check_file_exists_and_structure_sim")
def check_file_exists_and_structure_sim(src: str | None, tgt: str | None) -> float:
    """1 iff the exported file exists and looks like the target (SSIM >= 0.9)."""
    if src is None or tgt is None or not os.path.isfile(src):
        return 0.0
    return float(same_structure_ssim(_open(src), _open(tgt)))


@METRICS.register("check_triangle_position")
def check_triangle_position(tgt: str | None) -> float:
    """1 iff the second most common colour's centroid is within 5 % of the image centre."""
    if tgt is None:
        return 0.0
    arr = np.array(_open(tgt))
    colors, counts = np.unique(arr.reshape(-1, arr.shape[2]), axis=0, return_counts=True)
    triangle = colors[np.argsort(counts)][1]
    centroid = np.argwhere(np.all(arr == triangle, axis=2)).mean(axis=0)
    center = np.array(arr.shape[:2]) / 2
    return float(np.all(np.abs(centroid - center) < 0.05 * np.array(arr.shape[:2])))


@METRICS.register("check_structure_sim")
def check_structure_sim(src: str | None, tgt: str | None) -> float:
    """1 iff the two images have the same size and SSIM >= 0.9."""
    if src is None or tgt is None:
        return 0.0
    try:
        a, b = _open(src), _open(tgt)
        return float(a.size == b.size and same_structure_ssim(a, b))
    except Exception:  # noqa: BLE001 - unreadable images: 0, as upstream
        return 0.0


@METRICS.register("check_structure_sim_resized")
def check_structure_sim_resized(src: str | None, tgt: str | None) -> float:
    """1 iff ``src``, cropped to its opaque content when it has transparency and resized to the
    target's size, has SSIM >= 0.9 with the target.
    """  # noqa: D205
    if src is None or tgt is None:
        return 0.0
    a, b = _open(src), _open(tgt)
    if a.mode in ("RGBA", "LA") or "transparency" in a.info:
        a = a.convert("RGBA") if a.mode != "RGBA" else a
        box = a.split()[-1].getbbox()
        if box is None:
            return 0.0
        a = a.crop(box).convert("RGB").resize(b.size)
    else:
        a = a.resize(b.size)
    return float(same_structure_ssim(a, b if b.mode == "RGB" else b.convert("RGB")))


@METRICS.register("check_structure_sim_with_threshold")
def check_structure_sim_with_threshold(src: str | None, tgt: str | None, **options: Any) -> float:
    """1 iff SSIM (``src`` resized to the target) >= ``ssim_threshold`` (default 0.85)."""
    if src is None or tgt is None:
        return 0.0
    try:
        a, b = _open(src), _open(tgt)
        if a.size != b.size:
            a = a.resize(b.size, Image.Resampling.LANCZOS)
        x, y = np.array(a.convert("RGB")), np.array(b.convert("RGB"))
        win = _win(x)
        if win is None:
            return 0.0
        return float(
            _ssim(x, y, win_size=win, channel_axis=2) >= options.get("ssim_threshold", 0.85)
        )
    except Exception:  # noqa: BLE001 - unreadable images: 0, as upstream
        return 0.0


@METRICS.register("check_contrast_increase_and_structure_sim")
def check_contrast_increase_and_structure_sim(src: str | None, tgt: str | None) -> float:
    """1 iff ``src`` has a larger pixel standard deviation than ``tgt`` and SSIM >= 0.65."""
    if src is None or tgt is None:
        return 0.0
    a, b = _open(src), _open(tgt)
    std = lambda im: float(np.std(np.asarray(im, dtype=np.float32)))  # noqa: E731
    return float(std(b) < std(a) and same_structure_ssim(a, b, threshold=0.65))


@METRICS.register("check_config_status")
def check_config_status(config: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff a line ``(key ... value)`` of the GIMP config has the key and value of ``rule``.

    ``rule["key"]`` is one word or two (the first two words of the line); the value is the last.
    """
    if config is None:
        return 0.0
    with open(config) as f:
        lines = f.readlines()
    key, value = rule["key"], rule["value"]
    for line in lines:
        if line.startswith("#") or line == "\n":
            continue
        items = line.strip().lstrip("(").rstrip(")\n").split()
        if isinstance(key, str) and items[0] == key and items[-1] == value:
            return 1.0
        if isinstance(key, list) and len(key) == 2 and items[:2] == key and items[-1] == value:
            return 1.0
    return 0.0


@METRICS.register("check_image_size")
def check_image_size(src: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff the image has ``rule["width"]`` / ``rule["height"]`` (those given).

    With ``ignore_transparent`` (or whenever the image has a transparency key) the size is that
    of the opaque content's bounding box.
    """
    if src is None:
        return 0.0
    img = _open(src)
    if (
        rule.get("ignore_transparent", False) and img.mode in ("RGBA", "LA")
    ) or "transparency" in img.info:
        img = img.convert("RGBA") if img.mode != "RGBA" else img
        box = img.split()[-1].getbbox()
        w, h = (0, 0) if box is None else (box[2] - box[0], box[3] - box[1])
    else:
        w, h = img.size
    ok_h = rule.get("height") is None or h == rule["height"]
    ok_w = rule.get("width") is None or w == rule["width"]
    return float(ok_h and ok_w)


@METRICS.register("check_palette_and_structure_sim")
def check_palette_and_structure_sim(src: str | None, tgt: str | None) -> float:
    """1 iff ``src`` is a palette image (mode P) that looks like the target (SSIM >= 0.9)."""
    if src is None or tgt is None or not os.path.exists(src) or not os.path.exists(tgt):
        return 0.0
    try:
        a, b = _open(src), _open(tgt)
        a.load()
        b.load()
        return float(a.mode == "P" and same_structure_ssim(a.convert("RGB"), b))
    except Exception:  # noqa: BLE001 - unreadable images: 0, as upstream
        return 0.0


@METRICS.register("check_textbox_on_leftside")
def check_textbox_on_leftside(src: str | None) -> float:
    """1 iff the leftmost dark pixel (grey < 128) lies in the left 5 % of the image."""
    if src is None:
        return 0.0
    img = _open(src)
    dark = np.array(img.convert("L")) < 128
    cols = np.nonzero(dark.any(axis=0))[0]
    left = int(cols[0]) if cols.size else img.width
    return float(left < img.width * 0.05)


@METRICS.register("check_image_mirror")
def check_image_mirror(src: str | None, tgt: str | None) -> float:
    """1 iff ``src`` flipped left-right looks like the target (SSIM >= 0.99)."""
    if src is None or tgt is None:
        return 0.0
    flipped = _open(src).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return float(same_structure_ssim(flipped, _open(tgt), 0.99))


@METRICS.register("check_green_background")
def check_green_background(src: str | None, tgt: str | None) -> float:
    """1 iff wherever the target is not black the source is green-dominant (G > R, G > B).

    Pixels are indexed ``[x, y]`` over the target's width and height, as upstream does.
    """
    if src is None or tgt is None:
        return 0.0
    s, t = np.array(_open(src)), _open(tgt)
    tp = np.array(t)
    for x in range(t.width):
        for y in range(t.height):
            if tuple(tp[x, y][:3]) != (0, 0, 0):
                r, g, b = (int(c) for c in s[x, y][:3])
                if not (g > r and g > b):
                    return 0.0
    return 1.0

"""The in-jail pyautogui shim's pure parts, on the host: tweens, PNG codec, exact-match locate."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from osworld_jax.env.local.shim import pyautogui as shim
from osworld_jax.env.local.shim import pyscreeze, pytweening

# pyautogui 0.9.54 / pytweening names: linear + 30 ease functions.
EASES = [
    f"ease{kind}{name}"
    for name in (
        "Quad",
        "Cubic",
        "Quart",
        "Quint",
        "Sine",
        "Expo",
        "Circ",
        "Elastic",
        "Back",
        "Bounce",
    )
    for kind in ("In", "Out", "InOut")
]


def test_every_tween_name_is_exported_and_runs_from_0_to_1():
    assert len(EASES) == 30
    for name in ["linear", *EASES]:
        fn = getattr(shim, name)
        assert callable(fn), name
        # The elastic eases end within their 2^-10 decay of the endpoint, not exactly on it
        # (easeInElastic(0) = -2^-10 sin(...), as in pytweening).
        tol = 2**-10 if "Elastic" in name else 1e-9
        assert fn(0.0) == pytest.approx(0.0, abs=tol), name
        assert fn(1.0) == pytest.approx(1.0, abs=tol), name
    with pytest.raises(ValueError, match="between 0.0 and 1.0"):
        shim.linear(1.5)


def test_tween_values_match_the_penner_equations():
    # Hand-derived: quad n^2 / 1-(1-n)^2; in-out halves; sine; bounce's second parabola.
    assert shim.easeInQuad(0.5) == pytest.approx(0.25)
    assert shim.easeOutQuad(0.5) == pytest.approx(0.75)
    assert shim.easeInOutQuad(0.25) == pytest.approx(0.125)
    assert shim.easeInOutQuad(0.75) == pytest.approx(0.875)
    assert shim.easeInCubic(0.5) == pytest.approx(0.125)
    assert shim.easeInOutCubic(0.75) == pytest.approx(1 - 0.5**3 / 2)
    assert shim.easeOutQuint(0.5) == pytest.approx(1 - 0.5**5)
    assert shim.easeInSine(0.5) == pytest.approx(1 - math.cos(math.pi / 4))
    assert shim.easeInExpo(0.5) == pytest.approx(2**-5)
    assert shim.easeInOutExpo(0.25) == pytest.approx(0.5 * 2**-5)
    assert shim.easeInCirc(0.6) == pytest.approx(1 - math.sqrt(1 - 0.36))
    # easeOutBounce(0.5): 7.5625 (0.5 - 1.5/2.75)^2 + 0.75.
    assert shim.easeOutBounce(0.5) == pytest.approx(7.5625 * (0.5 - 1.5 / 2.75) ** 2 + 0.75)
    assert shim.easeInBounce(0.5) == pytest.approx(1 - shim.easeOutBounce(0.5))
    # easeInBack dips below 0 (backs up) and easeOutElastic overshoots 1.
    assert shim.easeInBack(0.2) < 0
    assert max(shim.easeOutElastic(k / 100) for k in range(101)) > 1
    assert pytweening.getPointOnLine(0, 10, 100, 20, 0.25) == (25.0, 12.5)


def _png(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode if mode != "P" else None).convert(mode).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P"])
def test_png_decoder_reads_what_pillow_writes(mode):
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, size=(13, 21, 3), dtype=np.uint8)
    if mode == "P":  # few colors so the palette is exact
        rgb = (rgb // 128 * 255).astype(np.uint8)
    src = Image.fromarray(rgb, "RGB")
    im = src.convert(mode)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    got = pyscreeze.decode_png(buf.getvalue())
    want = np.asarray(im.convert("RGB"))
    assert got.size == (21, 13)
    np.testing.assert_array_equal(np.frombuffer(got.data, np.uint8).reshape(13, 21, 3), want)
    # And the encoder round-trips through Pillow.
    out = io.BytesIO()
    got.save(out)
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(out.getvalue()))), want)


def _haystack(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 4, size=(60, 80, 3), dtype=np.uint8) * 60


def _img(arr: np.ndarray) -> pyscreeze.Image:
    return pyscreeze.Image(arr.shape[1], arr.shape[0], arr.tobytes())


def _brute_force(hay: np.ndarray, needle: np.ndarray) -> list[tuple[int, int]]:
    hh, hw = hay.shape[:2]
    nh, nw = needle.shape[:2]
    return [
        (x, y)
        for y in range(hh - nh + 1)
        for x in range(hw - nw + 1)
        if np.array_equal(hay[y : y + nh, x : x + nw], needle)
    ]


def test_locate_finds_exact_matches_in_row_order_like_pyscreeze(tmp_path):
    hay = _haystack()
    hay[40:43, 5:7] = hay[10:13, 30:32]  # a second copy of the needle
    needle = hay[10:13, 30:32].copy()
    want = _brute_force(hay, needle)
    assert len(want) >= 2
    got = [(b.left, b.top) for b in pyscreeze.locateAll(_img(needle), _img(hay))]
    assert got == want
    # A needle given as a PNG file, with an alpha channel that is dropped (as convert('RGB')).
    rgba = np.concatenate([needle, np.full(needle.shape[:2] + (1,), 7, np.uint8)], axis=2)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "n.png")
    box = pyscreeze.locate(str(tmp_path / "n.png"), _img(hay))
    assert (box.left, box.top, box.width, box.height) == (*want[0], 2, 3)
    assert pyscreeze.center(box) == (want[0][0] + 1, want[0][1] + 1)
    # region: offsets are reported in screen coordinates, only matches inside count.
    box = pyscreeze.locate(_img(needle), _img(hay), region=(0, 30, 80, 30))
    assert (box.left, box.top) == (5, 40)


def test_locate_grayscale_uses_pillow_luma():
    hay = _haystack(1)
    needle = hay[20:24, 10:15].copy()
    gray = np.asarray(Image.fromarray(hay, "RGB").convert("L"))
    target = gray[20:24, 10:15]
    exp = _brute_force(gray[..., None], target[..., None])
    got = [(b.left, b.top) for b in pyscreeze.locateAll(_img(needle), _img(hay), grayscale=True)]
    assert got == exp


def test_not_found_and_confidence_behave_as_pyautogui_without_opencv():
    hay = _img(_haystack())
    needle = _img(np.full((3, 3, 3), 255, np.uint8))  # 255 never occurs (values are 0..180)
    with pytest.raises(shim.ImageNotFoundException):
        shim.locate(needle, hay)
    assert issubclass(shim.ImageNotFoundException, shim.PyAutoGUIException)
    with pytest.raises(pyscreeze.ImageNotFoundException):
        list(pyscreeze.locateAll(needle, hay))
    with pytest.raises(NotImplementedError, match="only available if OpenCV"):
        shim.locate(needle, hay, confidence=0.9)
    with pytest.raises(pyscreeze.PyScreezeException, match="PyGetWindow"):
        shim.locateOnWindow(needle, "title")

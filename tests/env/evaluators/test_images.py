"""Image metrics (upstream ``metrics/gimp.py``, ``compare_images`` of ``vlc.py``) on PNGs."""

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageEnhance

from osworld_jax.env.evaluators import METRICS


def m(name):
    return METRICS.get(name)


def scene(w=64, h=48, bg=(200, 200, 200), fg=(30, 60, 150), box=(10, 10, 40, 30)):
    """A flat background with a rectangle: enough structure for SSIM."""

    def make():
        img = Image.new("RGB", (w, h), bg)
        ImageDraw.Draw(img).rectangle(box, fill=fg)
        ImageDraw.Draw(img).ellipse((42, 20, 60, 44), fill=(180, 40, 40))
        return img

    return make


@pytest.fixture
def base(src):
    return src.image("base.png", scene())


def test_compare_images_and_image_list(src, base):
    f = m("compare_images")
    assert f(base, src.image("same.png", scene())) == pytest.approx(1.0)
    other = src.image("o.png", scene(box=(5, 5, 60, 40), fg=(250, 250, 0)))
    s = f(other, base)
    assert 0.0 < s < 0.9
    # rescaled above a reference: (s - b) / (1 - b) when s >= b + 0.01, else 0
    assert f(base, base, reference_base_result=0.5) == pytest.approx(1.0)
    assert f(other, base, reference_base_result=0.99) == 0.0
    assert f(None, base) == 0.0
    g = m("compare_image_list")
    assert g([base, base], [src.image("s2.png", scene()), base]) == 1.0
    assert g([base, other], [base, base]) == 0.0
    assert g(base, base) == 1.0 and g(None, base) == 0.0
    # upstream quirk kept: an RGBA difference's bounding box looks at alpha only, so two opaque
    # RGBA images of different pictures are "equal" (docs/EVALUATORS.md)
    red = src.image("red.png", lambda: Image.new("RGBA", (8, 8), (255, 0, 0, 255)))
    blue = src.image("blue.png", lambda: Image.new("RGBA", (8, 8), (0, 0, 255, 255)))
    assert g([red], [blue]) == 1.0


def _adjust(src, name, base, enhancer, factor):
    return src.image(name, lambda: enhancer(Image.open(base)).enhance(factor))


def test_brightness_saturation_contrast_changes(src, base):
    darker = _adjust(src, "d.png", base, ImageEnhance.Brightness, 0.7)
    brighter = _adjust(src, "b.png", base, ImageEnhance.Brightness, 1.3)
    f = m("check_brightness_decrease_and_structure_sim")
    assert f(darker, base) == 1.0
    assert f(brighter, base) == 0.0
    assert (
        f(src.image("x.png", scene(box=(0, 0, 63, 47), fg=(0, 0, 0))), base) == 0.0
    )  # other picture

    def saturate(factor):
        def make():
            h, s, v = Image.open(base).convert("HSV").split()
            s = s.point(lambda x: min(255, int(x * factor)))
            return Image.merge("HSV", (h, s, v)).convert("RGB")

        return make

    sat = src.image("s.png", saturate(1.4))
    desat = src.image("u.png", saturate(0.6))
    g = m("check_saturation_increase_and_structure_sim")
    assert g(sat, base) == 1.0 and g(desat, base) == 0.0
    con = _adjust(src, "c.png", base, ImageEnhance.Contrast, 1.5)
    flat = _adjust(src, "f.png", base, ImageEnhance.Contrast, 0.6)
    h = m("check_contrast_increase_and_structure_sim")
    assert h(con, base) == 1.0 and h(flat, base) == 0.0


def test_structure_similarity_family(src, base):
    same = src.image("same.png", scene())
    moved = src.image("m.png", scene(box=(30, 5, 62, 25)))
    assert m("check_structure_sim")(same, base) == 1.0
    assert m("check_structure_sim")(moved, base) == 0.0
    assert m("check_structure_sim")(src.image("big.png", scene(w=128, h=96)), base) == 0.0  # size
    assert m("check_file_exists_and_structure_sim")(same, base) == 1.0
    assert m("check_file_exists_and_structure_sim")(str(src.root / "nope.png"), base) == 0.0
    big = src.image("r.png", lambda: Image.open(base).resize((128, 96), Image.Resampling.LANCZOS))
    assert m("check_structure_sim_resized")(big, base) == 1.0
    assert m("check_structure_sim_resized")(moved, base) == 0.0
    assert m("check_structure_sim_with_threshold")(big, base) == 1.0  # resized to the target
    assert m("check_structure_sim_with_threshold")(moved, base, ssim_threshold=0.95) == 0.0
    mirrored = src.image(
        "mi.png", lambda: Image.open(base).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    )
    assert m("check_image_mirror")(base, mirrored) == 1.0
    assert m("check_image_mirror")(base, same) == 0.0
    pal = src.image("p.png", lambda: Image.open(base).convert("P", palette=Image.Palette.ADAPTIVE))
    assert m("check_palette_and_structure_sim")(pal, base) == 1.0
    assert m("check_palette_and_structure_sim")(same, base) == 0.0  # RGB, not a palette


def test_sizes_positions_and_config(src):
    def alpha(make):
        return lambda: make()

    opaque = src.image("o.png", lambda: Image.new("RGB", (300, 200), (1, 2, 3)))
    f = m("check_image_size")
    assert f(opaque, {"width": 300, "height": 200}) == 1.0
    assert f(opaque, {"height": 201}) == 0.0

    def transparent():
        img = Image.new("RGBA", (100, 100), (0, 0, 0, 0))
        ImageDraw.Draw(img).rectangle((10, 20, 59, 49), fill=(255, 0, 0, 255))  # 50 x 30 content
        return img

    t = src.image("t.png", transparent)
    assert f(t, {"width": 50, "height": 30, "ignore_transparent": True}) == 1.0
    assert f(t, {"width": 100, "height": 100}) == 1.0

    def triangle(center):
        def make():
            img = Image.new("RGB", (100, 100), (255, 255, 255))
            cx, cy = center
            ImageDraw.Draw(img).polygon(
                [(cx - 10, cy + 8), (cx + 10, cy + 8), (cx, cy - 12)], fill=(250, 220, 0)
            )
            img.putpixel((0, 0), (0, 0, 0))  # a rarest colour: upstream takes the 2nd rarest
            return img

        return make

    g = m("check_triangle_position")
    assert g(src.image("mid.png", triangle((50, 52)))) == 1.0
    assert g(src.image("off.png", triangle((20, 20)))) == 0.0

    def text_at(x):
        def make():
            img = Image.new("RGB", (200, 60), (255, 255, 255))
            ImageDraw.Draw(img).rectangle((x, 20, x + 40, 30), fill=(0, 0, 0))
            return img

        return make

    h = m("check_textbox_on_leftside")
    assert h(src.image("l.png", text_at(3))) == 1.0  # 3 < 5 % of 200
    assert h(src.image("r.png", text_at(50))) == 0.0

    cfg = src.text(
        "gimprc", '# GIMP gimprc\n\n(undo-levels 5)\n(theme "Dark")\n(default-image (width 640))\n'
    )
    c = m("check_config_status")
    assert c(cfg, {"key": "undo-levels", "value": "5"}) == 1.0
    assert c(cfg, {"key": "undo-levels", "value": "7"}) == 0.0
    assert c(cfg, {"key": "theme", "value": '"Dark"'}) == 1.0  # the value keeps its quotes
    assert c(cfg, {"key": ["default-image", "(width"], "value": "640"}) == 1.0  # ")" stripped


def test_green_background(src):
    def pic(bg):
        def make():
            img = Image.new("RGB", (40, 40), bg)
            ImageDraw.Draw(img).rectangle((10, 10, 30, 30), fill=(0, 0, 0))
            return img

        return make

    target = src.image("t.png", pic((255, 255, 255)))
    f = m("check_green_background")
    assert f(src.image("g.png", pic((0, 200, 0))), target) == 1.0
    assert f(src.image("b.png", pic((0, 0, 200))), target) == 0.0
    arr = np.array(Image.open(target))
    assert tuple(arr[20, 20]) == (0, 0, 0)  # the object is excluded from the check

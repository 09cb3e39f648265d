"""Presentation metrics (LibreOffice Impress tasks) over PPTX files read with python-pptx.

Follows upstream ``desktop_env/evaluators/metrics/slides.py``. ``compare_pptx_files(result,
expected, **options)`` scores 1 when the result presentation matches the gold one in every
examined aspect and 0 at the first difference; each ``examine_*`` option turns one aspect off
(or, for the position checks that are off by default, on). Aspects, as upstream compares them:

- slide count; each slide's solid background colour (its own, or the master's when it follows the
  master); the notes text; the number of top-level shapes;
- each shape's position and size, equal within ``approximately_tolerance`` (relative, default
  0.005), unless both shapes hold no text (decorative shapes move between saves);
- tables: the grid size, per cell the paragraph and run counts, per run colour, bold, italic and
  underline (a missing bold/italic equals False);
- text shapes: the text; per paragraph the alignment (None = left), text, level (0 and 1 count as
  the same indent) and runs; per run the font name, size, bold, italic, colour, underline,
  strike-through and the slide's bullets (character, level and text of each non-empty
  paragraph); runs of paragraphs whose text is blank are compared without their blank runs;
- again over every text shape, group members included: the text and paragraph alignments.

A ``None`` result (the file is missing) scores 0.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

from lxml import etree

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import parse_xml, parse_xml_file

_A = "http://schemas.openxmlformats.org/drawingml/2006/main"
_P = "http://schemas.openxmlformats.org/presentationml/2006/main"
_NS = {"a": _A, "p": _P}
_OOR = "http://openoffice.org/2001/registry"

_PICTURE, _TABLE, _FREEFORM = 13, 19, 5  # MSO_SHAPE_TYPE values upstream compares with


def _presentation(path: str) -> Any:
    from pptx import Presentation

    return Presentation(path)


def _near(a: int, b: int, tol: float) -> bool:
    if a == b:
        return True
    if a == 0 or b == 0:
        return False
    return abs(a - b) / max(abs(a), abs(b)) <= tol


def _same_box(s1: Any, s2: Any, tol: float) -> bool:
    return all(
        _near(getattr(s1, k), getattr(s2, k), tol) for k in ("left", "top", "width", "height")
    )


def _background_rgb(slide: Any) -> Any:
    fill = slide.background.fill
    if fill.type == 1:  # MSO_FILL.SOLID
        return fill.fore_color.rgb
    if fill.type == 5:  # MSO_FILL.BACKGROUND: the master's
        master = slide.slide_layout.slide_master.background.fill
        return master.fore_color.rgb if master.type == 1 else None
    return None


def _text_shapes(shapes: Any) -> Iterator[Any]:
    for s in shapes:
        if hasattr(s, "text") and hasattr(s, "text_frame"):
            yield s
        if hasattr(s, "shapes"):
            yield from _text_shapes(s.shapes)


def _runs(p1: Any, p2: Any) -> tuple[list[Any], list[Any]]:
    """The runs to compare: without blank runs when both paragraphs' text is blank."""
    if (p1.text or "").strip() == "" and (p2.text or "").strip() == "":
        keep = lambda p: [r for r in p.runs if (r.text or "").strip() != ""]  # noqa: E731
        return keep(p1), keep(p2)
    return list(p1.runs), list(p2.runs)


def _false_like(v: Any) -> bool:
    return v is None or v is False


def _underline_differs(u1: Any, u2: Any) -> bool:
    if u1 == u2:
        return False
    if u1 is not None and u2 is not None:
        return True
    return (u1 is None and u2 is True) or (u1 is True and u2 is None)


def _color_differs(r1: Any, r2: Any) -> bool:
    if hasattr(r1.font.color, "rgb") and hasattr(r2.font.color, "rgb"):
        return bool(r1.font.color.rgb != r2.font.color.rgb)
    return False


def _bullets(xml: bytes) -> list[tuple[Any, str, str]]:
    root = parse_xml(xml)
    out = []
    for p in root.iter(f"{{{_A}}}p"):
        ppr = p.find("a:pPr", _NS)
        lvl, char = "No Level", "No Bullet"
        if ppr is not None:
            lvl = ppr.get("lvl")
            bu = ppr.find("a:buChar", _NS)
            char = bu.get("char") if bu is not None else "No Bullet"
        # an empty <a:t/> has no text: upstream's join raises and skips the bullet check
        text = "".join(t.text for t in p.iter(f"{{{_A}}}t"))  # type: ignore[misc]
        if text.strip():
            out.append((lvl, char, text))
    return out


def _bullets_match(b1: list[tuple[Any, str, str]], b2: list[tuple[Any, str, str]]) -> bool:
    if len(b1) != len(b2):
        return False
    for (l1, c1, t1), (l2, c2, t2) in zip(b1, b2, strict=True):
        if t1 != t2 or c1 != c2:
            return False
        if (c1 != "No Bullet" or c2 != "No Bullet") and ("0" if l1 is None else l1) != (
            "0" if l2 is None else l2
        ):
            return False
    return True


def _table_differs(t1: Any, t2: Any, o: Mapping[str, Any]) -> bool:
    if len(t1.rows) != len(t2.rows) or len(t1.columns) != len(t2.columns):
        return True
    for i in range(len(t1.rows)):
        for j in range(len(t1.columns)):
            c1, c2 = t1.cell(i, j), t2.cell(i, j)
            ps1, ps2 = c1.text_frame.paragraphs, c2.text_frame.paragraphs
            if len(ps1) != len(ps2):
                return True
            for p1, p2 in zip(ps1, ps2, strict=True):
                rs1, rs2 = _runs(p1, p2)
                if len(rs1) != len(rs2) and o["examine_run_count"]:
                    return True
                for r1, r2 in zip(rs1, rs2, strict=False):
                    if o["examine_color_rgb"] and _color_differs(r1, r2):
                        return True
                    for attr in ("bold", "italic"):
                        v1, v2 = getattr(r1.font, attr), getattr(r2.font, attr)
                        if v1 != v2 and not (_false_like(v1) and _false_like(v2)):
                            return True
                    if _underline_differs(r1.font.underline, r2.font.underline):
                        return True
    return False


def _run_differs(r1: Any, r2: Any, o: Mapping[str, Any]) -> bool:
    f1, f2 = r1.font, r2.font
    if o["examine_font_name"] and f1.name != f2.name:
        return True
    if o["examine_font_size"] and f1.size != f2.size:
        return True
    for attr in ("bold", "italic"):
        v1, v2 = getattr(f1, attr), getattr(f2, attr)
        if o[f"examine_font_{attr}"] and v1 != v2 and not (_false_like(v1) and _false_like(v2)):
            return True
    if o["examine_color_rgb"] and _color_differs(r1, r2):
        return True
    if o["examine_font_underline"] and _underline_differs(f1.underline, f2.underline):
        return True
    strike = lambda f: f._element.attrib.get("strike", "noStrike")  # noqa: E731
    if o["examine_strike_through"] and strike(f1) != strike(f2):
        return True
    if o["examine_bullets"]:
        try:
            b1, b2 = _bullets(r1.part.blob), _bullets(r2.part.blob)
        except Exception:  # noqa: BLE001 - upstream skips bullets it cannot read
            return False
        return not _bullets_match(b1, b2)
    return False


def _alignment(p: Any) -> Any:
    from pptx.enum.text import PP_ALIGN

    return PP_ALIGN.LEFT if p.alignment is None else p.alignment


def _text_differs(s1: Any, s2: Any, o: Mapping[str, Any]) -> bool:
    if o["examine_text"] and s1.text.strip() != s2.text.strip():
        return True
    ps1, ps2 = s1.text_frame.paragraphs, s2.text_frame.paragraphs
    if len(ps1) != len(ps2):
        return True
    for p1, p2 in zip(ps1, ps2, strict=True):
        if o["examine_alignment"] and _alignment(p1) != _alignment(p2):
            return True
        if o["examine_text"] and p1.text != p2.text:
            return True
        if o["examine_indent"] and p1.level != p2.level:
            n1, n2 = p1.level or 0, p2.level or 0
            if not (n1 in (0, 1) and n2 in (0, 1)):
                return True
        rs1, rs2 = _runs(p1, p2)
        if len(rs1) != len(rs2) and o["examine_run_count"]:
            return True
        if any(_run_differs(r1, r2, o) for r1, r2 in zip(rs1, rs2, strict=False)):
            return True
    return False


def _position_checks_fail(idx: int, s1: Any, s2: Any, o: Mapping[str, Any]) -> bool:  # noqa: C901
    """Upstream's task-specific position options, each off unless the task sets it."""
    tol = o["approximately_tolerance"]
    both_text = hasattr(s1, "text") and hasattr(s2, "text")
    if o["examine_title_bottom_position"]:
        if both_text and s1.text == s2.text:
            if s1.text == "Product Comparison" and (s1.top <= s2.top or s1.top < 3600000):
                return True
        elif not _same_box(s1, s2, tol):
            return True
    if o["examine_table_bottom_position"]:
        if idx == 3 and s1.shape_type == _TABLE and s2.shape_type == _TABLE:
            if s1.top <= s2.top or s1.top < 3600000:
                return True
        elif not _same_box(s1, s2, tol):
            return True
    if (
        o["examine_right_position"]
        and idx == 2
        and not hasattr(s1, "text")
        and not hasattr(s2, "text")
    ):
        if s1.left <= s2.left or s1.left < 4320000:
            return True
    if o["examine_top_position"] and idx == 2 and s1.shape_type == s2.shape_type == _PICTURE:
        if s1.top >= s2.top or s1.top > 1980000:
            return True
    if o["examine_shape_for_shift_size"] and not _same_box(s1, s2, tol):
        keep = both_text and s1.text == s2.text == "Elaborate on what you want to discuss."
        if not keep:
            return True
    blank = lambda s: not getattr(s, "text", None) or (s.text or "").strip() == ""  # noqa: E731
    if o["examine_shape"] and not _same_box(s1, s2, tol) and not (blank(s1) and blank(s2)):
        return True
    if o["examine_image_size"]:
        if s1.shape_type == s2.shape_type == _PICTURE:
            if not (_near(s1.width, s2.width, tol) and _near(s1.height, s2.height, tol)):
                return True
        elif not _same_box(s1, s2, tol):
            return True
    if o["examine_modify_height"]:
        no_text = not hasattr(s1, "text") and not hasattr(s2, "text")
        if no_text or s1.shape_type == s2.shape_type == _FREEFORM:
            if not _near(s1.height, s2.height, tol):
                return True
        elif not _same_box(s1, s2, tol):
            return True
    return False


_DEFAULTS = {
    "approximately_tolerance": 0.005,
    "examine_number_of_slides": True,
    "examine_shape": True,
    "examine_text": True,
    "examine_indent": True,
    "examine_font_name": True,
    "examine_font_size": True,
    "examine_font_bold": True,
    "examine_font_italic": True,
    "examine_color_rgb": True,
    "examine_font_underline": True,
    "examine_strike_through": True,
    "examine_alignment": True,
    "examine_title_bottom_position": False,
    "examine_table_bottom_position": False,
    "examine_run_count": True,
    "examine_right_position": False,
    "examine_top_position": False,
    "examine_shape_for_shift_size": False,
    "examine_image_size": False,
    "examine_modify_height": False,
    "examine_bullets": True,
    "examine_background_color": True,
    "examine_note": True,
}


def _slides_differ(idx: int, sl1: Any, sl2: Any, o: Mapping[str, Any]) -> bool:
    if o["examine_background_color"] and _background_rgb(sl1) != _background_rgb(sl2):
        return True
    notes = lambda s: s.notes_slide.notes_text_frame.text.strip()  # noqa: E731
    if o["examine_note"] and notes(sl1) != notes(sl2):
        return True
    if len(sl1.shapes) != len(sl2.shapes):
        return True
    for s1, s2 in zip(sl1.shapes, sl2.shapes, strict=True):
        if _position_checks_fail(idx, s1, s2, o):
            return True
        if s1.shape_type == _TABLE and _table_differs(s1.table, s2.table, o):
            return True
        if hasattr(s1, "text") and hasattr(s2, "text") and _text_differs(s1, s2, o):
            return True
    t1, t2 = list(_text_shapes(sl1.shapes)), list(_text_shapes(sl2.shapes))
    if len(t1) != len(t2):
        return True
    if o["examine_alignment"]:
        for a, b in zip(t1, t2, strict=True):
            if o["examine_text"] and a.text.strip() != b.text.strip():
                return True
            pa, pb = a.text_frame.paragraphs, b.text_frame.paragraphs
            if len(pa) != len(pb):
                return True
            if any(_alignment(x) != _alignment(y) for x, y in zip(pa, pb, strict=True)):
                return True
    return False


@METRICS.register("compare_pptx_files")
def compare_pptx_files(result: str | None, expected: str, **options: Any) -> float:
    """1 iff the result presentation matches the gold one (see the module docstring)."""
    if result is None:
        return 0.0
    o = {**_DEFAULTS, **{k: v for k, v in options.items() if k in _DEFAULTS}}
    p1, p2 = _presentation(result), _presentation(expected)
    if o["examine_number_of_slides"] and len(p1.slides) != len(p2.slides):
        return 0.0
    for idx, (s1, s2) in enumerate(zip(p1.slides, p2.slides, strict=False), start=1):
        if _slides_differ(idx, s1, s2, o):
            return 0.0
    return 1.0


# ------------------------------------------------------------------ single-property checks


def _registry_items(path: str, item_path: str) -> Iterator[Any]:
    root = parse_xml_file(path)
    yield from root.iterfind(f".//item[@{{{_OOR}}}path='{item_path}']")


@METRICS.register("check_presenter_console_disable")
def check_presenter_console_disable(config_file: str | None) -> float:
    """1 iff LibreOffice's ``registrymodifications.xcu`` sets ``EnablePresenterScreen`` false."""
    try:
        for item in _registry_items(str(config_file), "/org.openoffice.Office.Impress/Misc/Start"):
            prop = item.find(f"prop[@{{{_OOR}}}name='EnablePresenterScreen']")
            if prop is not None:
                return float((prop.findtext("value") or "").lower() == "false")
    except Exception:  # noqa: BLE001 - upstream scores an unreadable file 0
        return 0.0
    return 0.0


@METRICS.register("check_auto_saving_time")
def check_auto_saving_time(config_file: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the configured auto-save interval (``AutoSaveTimeIntervall``) is ``rules["minutes"]``.

    Reads ``registrymodifications.xcu`` (item ``/org.openoffice.Office.Common/Save/Document``).
    """
    value = None
    try:
        for item in _registry_items(
            str(config_file), "/org.openoffice.Office.Common/Save/Document"
        ):
            for prop in item.iter("prop"):
                if prop.get(f"{{{_OOR}}}name") == "AutoSaveTimeIntervall":
                    value = prop.findtext(".//value")  # the last such item wins, as upstream
                    break
        return float(value is not None and int(value) == rules["minutes"])
    except (OSError, etree.XMLSyntaxError, ValueError):
        return 0.0


@METRICS.register("check_slide_orientation_Portrait")
def check_slide_orientation_portrait(pptx_file: str | None) -> float:
    """1 iff the slides are taller than wide."""
    if pptx_file is None:
        return 0.0
    prs = _presentation(pptx_file)
    return float(prs.slide_width < prs.slide_height)


@METRICS.register("check_transition")
def check_transition(pptx_file: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff slide ``rules["slide_idx"]`` (0-based) has a ``p:<transition_type>`` transition."""
    if pptx_file is None:
        return 0.0
    name = f"ppt/slides/slide{int(rules['slide_idx']) + 1}.xml"
    with zipfile.ZipFile(pptx_file) as z:
        if name not in z.namelist():
            return 0.0
        root = parse_xml(z.read(name))
    tr = root.find(".//p:transition", _NS)
    if tr is None:
        return 0.0
    return float(tr.find(f".//p:{rules['transition_type']}", _NS) is not None)


def _solid_rgb(color: Any) -> tuple[int, int, int] | None:
    try:
        rgb = color.rgb
    except AttributeError:
        return None
    return None if rgb is None else (rgb[0], rgb[1], rgb[2])


@METRICS.register("evaluate_presentation_fill_to_rgb_distance")
def evaluate_presentation_fill_to_rgb_distance(
    pptx_file: str | None, rules: Mapping[str, Any]
) -> float:
    """``1 - mean over slides of d(background, rules["rgb"])``, ``d`` the RGB distance / its max.

    A slide whose background is not a solid colour (its own or the master's), or still has
    ``rules["original_rgb"]``, counts distance 1.
    """
    if pptx_file is None:
        return 0.0
    want, original = rules["rgb"], rules.get("original_rgb")

    def distance(slide: Any) -> float:
        fill = slide.background.fill
        if fill.type == 5:
            fill = slide.slide_layout.slide_master.background.fill
        elif fill.type != 1:
            return 1.0
        if fill.type != 1:
            return 1.0
        rgb = _solid_rgb(fill.fore_color)
        if rgb is None or (original is not None and list(rgb) == list(original)):
            return 1.0
        return math.dist(rgb, want) / math.dist((0, 0, 0), (255, 255, 255))

    prs = _presentation(pptx_file)
    slides = list(prs.slides)
    return 1.0 - sum(distance(s) for s in slides) / len(slides)


@METRICS.register("check_left_panel")
def check_left_panel(accessibility_tree: str | None) -> float:
    """1 iff the accessibility tree has a ``document-frame`` named "Slides View" (panel shown)."""
    if not accessibility_tree:
        return 0.0
    root = parse_xml(accessibility_tree)
    return float(any(e.get("name") == "Slides View" for e in root.iter("document-frame")))


def _hex_rgb(text: str | None) -> tuple[int, int, int] | None:
    s = (text or "").lstrip("#")
    if len(s) != 6:
        return None
    try:
        return int(s[0:2], 16), int(s[2:4], 16), int(s[4:6], 16)
    except ValueError:
        return None


def _slide_number_color(master: Any) -> str | None:
    """The slide-number colour of a slide master (upstream's fallbacks, in order)."""
    srgb = ".//a:solidFill//a:srgbClr"
    ph = master.find(".//p:ph[@type='sldNum']", _NS)
    if ph is not None:
        c = ph.find(srgb, _NS)
        if c is not None:
            return c.get("val")
    for ph in master.findall(".//p:ph", _NS):
        if ph.get("type") in ("sldNum", "ftr", "dt"):
            c = ph.find(srgb, _NS)
            if c is not None:
                return c.get("val")
    for c in reversed(master.findall(".//a:rPr//a:solidFill//a:srgbClr", _NS)):
        if c.get("val") and c.get("val") != "000000":
            return c.get("val")
    every = master.findall(srgb, _NS)
    for c in reversed(every):
        if c.get("val") and c.get("val") != "000000":
            return c.get("val")
    return every[-1].get("val") if every else None


@METRICS.register("check_page_number_colors")
def check_page_number_colors(pptx_file: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the first slide master's page-number colour is ``rules["color"]``.

    ``red`` / ``green`` / ``blue``: that channel exceeds both others by more than 50; ``black``:
    every channel below 50; another colour name passes any colour.
    """
    if pptx_file is None:
        return 0.0
    with zipfile.ZipFile(pptx_file) as z:
        master = parse_xml(z.read("ppt/slideMasters/slideMaster1.xml"))
    rgb = _hex_rgb(_slide_number_color(master))
    if rgb is None:
        return 0.0
    r, g, b = rgb
    tests = {
        "red": r > g + 50 and r > b + 50,
        "green": g > r + 50 and g > b + 50,
        "blue": b > g + 50 and b > r + 50,
        "black": r < 50 and g < 50 and b < 50,
    }
    return float(tests.get(rules["color"], True))


@METRICS.register("check_image_stretch_and_center")
def check_image_stretch_and_center(modified_ppt: str | None, original_ppt: str) -> float:
    """1 iff the first slide's original picture now fills the slide (within half an inch) and
    is centred.
    """  # noqa: D205
    from pptx.util import Inches

    if modified_ppt is None:
        return 0.0
    orig, mod = _presentation(original_ppt), _presentation(modified_ppt)
    pics = lambda prs: [s for s in prs.slides[0].shapes if s.shape_type == _PICTURE]  # noqa: E731
    originals = pics(orig)
    if not originals:
        return 0.0
    target = None
    for img in pics(mod):
        if img.image.blob == originals[0].image.blob:
            target = img
    if target is None:
        return 0.0
    w, h, half = orig.slide_width, orig.slide_height, Inches(0.5)
    ok = (
        abs(target.width - w) <= half
        and abs(target.height - h) <= half
        and abs(target.left - (w - target.width) / 2) <= half
        and abs(target.top - (h - target.height) / 2) <= half
    )
    return float(ok)

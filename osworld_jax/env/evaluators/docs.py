"""Document metrics (LibreOffice Writer tasks) over DOCX (python-docx) and ODT (odfpy) files.

Follows upstream ``desktop_env/evaluators/metrics/docs.py`` (and ``fuzzy_place_math`` of
``general.py``). Paragraph text is python-docx's ``Paragraph.text`` for DOCX and, for ODT, the
direct text and ``text:span`` children of each ``text:p`` (nested spans, links and tabs are not
read, as upstream). A ``None`` file (missing) scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from lxml import etree

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import parse_xml_file

_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_OOR = "http://openoffice.org/2001/registry"


def _docx(path: str) -> Any:
    import docx

    return docx.Document(path)


def _odt_paragraphs(path: str) -> list[str]:
    from odf.opendocument import load
    from odf.text import P

    out = []
    for p in load(path).getElementsByType(P):
        parts = []
        for node in p.childNodes:
            if node.nodeType == node.TEXT_NODE:
                parts.append(node.data)
            elif node.nodeType == node.ELEMENT_NODE and node.tagName == "text:span":
                parts.extend(c.data for c in node.childNodes if c.nodeType == c.TEXT_NODE)
        out.append("".join(parts))
    return out


def _ratio(a: str, b: str) -> float:
    from rapidfuzz import fuzz

    return float(fuzz.ratio(a, b)) / 100.0


def _paragraphs(file1: str, file2: str) -> tuple[list[str], list[str]] | None:
    """Both documents' paragraph texts (both DOCX or both ODT), or None."""
    try:
        if file1.endswith(".docx") and file2.endswith(".docx"):
            return [p.text for p in _docx(file1).paragraphs], [
                p.text for p in _docx(file2).paragraphs
            ]
        if file1.endswith(".odt") and file2.endswith(".odt"):
            return _odt_paragraphs(file1), _odt_paragraphs(file2)
    except Exception:  # noqa: BLE001 - an unreadable document is not the answer (upstream: 0)
        return None
    return None


def _squash(paragraphs: Sequence[str]) -> str:
    return re.sub(r"\s+", " ", "\n".join(paragraphs)).strip()


@METRICS.register("compare_docx_files")
def compare_docx_files(file1: str | None, file2: str | None, **options: Any) -> float:
    """Paragraph text of two DOCX (or two ODT) documents: 1 if equal, or a fuzzy ratio.

    Options (upstream defaults): ``ignore_blanks`` (True: whitespace runs collapse over the
    whole text), ``ignore_case``, ``ignore_order`` (sort paragraphs), ``delete_empty_lines``,
    ``content_only`` (return the rapidfuzz ratio of the squashed texts), ``fuzzy_match`` (ratio
    of the squashed texts, or with ``ignore_blanks=False`` the mean ratio per paragraph).
    """
    if not file1 or not file2:
        return 0.0
    pair = _paragraphs(file1, file2)
    if pair is None:
        return 0.0
    p1, p2 = pair
    if options.get("ignore_order", False):
        p1, p2 = sorted(p1), sorted(p2)
    if options.get("delete_empty_lines", False):
        p1, p2 = [p for p in p1 if p.strip()], [p for p in p2 if p.strip()]
    fold = options.get("ignore_case", False)
    if options.get("content_only", False) or options.get("ignore_blanks", True):
        t1, t2 = _squash(p1), _squash(p2)
        if fold:
            t1, t2 = t1.lower(), t2.lower()
        if options.get("content_only", False) or options.get("fuzzy_match", False):
            return _ratio(t1, t2)
        return float(t1 == t2)
    if len(p1) != len(p2):
        return 0.0
    if fold:
        p1, p2 = [p.lower() for p in p1], [p.lower() for p in p2]
    if options.get("fuzzy_match", False):
        return 1.0 if not p1 else sum(_ratio(a, b) for a, b in zip(p1, p2, strict=True)) / len(p1)
    return float(p1 == p2)


@METRICS.register("compare_docx_files_and_ignore_new_lines")
def compare_docx_files_and_ignore_new_lines(
    file1: str | None, file2: str | None, **options: Any
) -> float:
    """Like ``compare_docx_files`` on DOCX only, empty paragraphs dropped first."""
    if not file1 or not file2 or not (file1.endswith(".docx") and file2.endswith(".docx")):
        return 0.0
    try:
        p1 = [p.text for p in _docx(file1).paragraphs if p.text != ""]
        p2 = [p.text for p in _docx(file2).paragraphs if p.text != ""]
    except Exception:  # noqa: BLE001 - unreadable: 0, as upstream
        return 0.0
    if options.get("ignore_blanks", True):
        return float(_squash(p1) == _squash(p2))
    return float(p1 == p2)


def _both(file1: str | None, file2: str | None) -> tuple[Any, Any] | None:
    if not file1 or not file2:
        return None
    try:
        return _docx(file1), _docx(file2)
    except Exception:  # noqa: BLE001 - unreadable: 0, as upstream
        return None


@METRICS.register("compare_docx_tables")
def compare_docx_tables(file1: str | None, file2: str | None) -> float:
    """1 iff both documents have the same tables: shape and stripped cell texts."""
    docs = _both(file1, file2)
    if docs is None:
        return 0.0
    t1, t2 = docs[0].tables, docs[1].tables
    if len(t1) != len(t2):
        return 0.0
    for a, b in zip(t1, t2, strict=True):
        if len(a.rows) != len(b.rows) or len(a.columns) != len(b.columns):
            return 0.0
        for i in range(len(a.rows)):
            for j in range(len(a.columns)):
                if a.cell(i, j).text.strip() != b.cell(i, j).text.strip():
                    return 0.0
    return 1.0


@METRICS.register("compare_docx_images")
def compare_docx_images(file1: str | None, file2: str | None) -> float:
    """1 iff both documents embed the same images (same count, same decoded pixels, in order)."""
    import io

    from PIL import Image

    docs = _both(file1, file2)
    if docs is None:
        return 0.0

    def images(d: Any) -> list[bytes]:
        blobs = [r.target_part.blob for r in d.part.rels.values() if "image" in r.reltype]
        return [Image.open(io.BytesIO(b)).tobytes() for b in blobs]

    i1, i2 = images(docs[0]), images(docs[1])
    return float(len(i1) == len(i2) and all(a == b for a, b in zip(i1, i2, strict=True)))


@METRICS.register("compare_line_spacing")
def compare_line_spacing(file1: str | None, file2: str | None) -> float:
    """1 iff the texts match (``compare_docx_files``) and every paragraph's line spacing too."""
    if not file1 or not file2 or not compare_docx_files(file1, file2):
        return 0.0
    docs = _both(file1, file2)
    if docs is None:
        return 0.0
    p1, p2 = docs[0].paragraphs, docs[1].paragraphs
    if len(p1) != len(p2):
        return 0.0
    return float(
        all(
            a.paragraph_format.line_spacing == b.paragraph_format.line_spacing
            for a, b in zip(p1, p2, strict=True)
        )
    )


@METRICS.register("compare_font_names")
def compare_font_names(file: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff every run of every paragraph names the font ``rules["font_name"]``."""
    if not file:
        return 0.0
    try:
        d = _docx(file)
    except Exception:  # noqa: BLE001
        return 0.0
    want = rules["font_name"]
    return float(all(r.font.name == want for p in d.paragraphs for r in p.runs))


@METRICS.register("compare_subscript_contains")
def compare_subscript_contains(file1: str | None, file2: str | None) -> float:
    """1 iff some pair of aligned runs (same paragraph and run index) are both subscript."""
    docs = _both(file1, file2)
    if docs is None:
        return 0.0
    for a, b in zip(docs[0].paragraphs, docs[1].paragraphs, strict=False):
        for r1, r2 in zip(a.runs, b.runs, strict=False):
            if r1.font.subscript and r2.font.subscript:
                return 1.0
    return 0.0


@METRICS.register("has_page_numbers_in_footers")
def has_page_numbers_in_footers(file: str | None) -> float:
    """1 iff every section's footer's first paragraph contains a digit."""
    if not file:
        return 0.0
    try:
        d = _docx(file)
    except Exception:  # noqa: BLE001
        return 0.0
    for section in d.sections:
        paras = section.footer.paragraphs
        text = paras[0].text if paras else ""
        if not any(ch.isdigit() for ch in text):
            return 0.0
    return 1.0


@METRICS.register("is_first_line_centered")
def is_first_line_centered(file: str | None) -> float:
    """1 iff the first paragraph is centred."""
    from docx.enum.text import WD_PARAGRAPH_ALIGNMENT

    if not file:
        return 0.0
    try:
        d = _docx(file)
    except Exception:  # noqa: BLE001
        return 0.0
    return float(d.paragraphs[0].paragraph_format.alignment == WD_PARAGRAPH_ALIGNMENT.CENTER)


@METRICS.register("check_tabstops")
def check_tabstops(file1: str | None, file2: str | None, **kwargs: Any) -> float:
    """``1 - mean over non-empty paragraphs of sum |tab position difference| / text width``.

    Tab stops are compared pairwise in order (cleared and left-at-0 stops ignored); a paragraph
    count, tab count or tab alignment mismatch scores 0. With ``word_number_split_by_tabstop=n``
    the ``index``-th tab-separated part of each result paragraph must hold exactly n words.
    """
    from docx.enum.text import WD_TAB_ALIGNMENT

    docs = _both(file1, file2)
    if docs is None:
        return 0.0
    p1 = [p for p in docs[0].paragraphs if p.text.strip()]
    p2 = [p for p in docs[1].paragraphs if p.text.strip()]
    if len(p1) != len(p2):
        return 0.0
    n = kwargs.get("word_number_split_by_tabstop")
    if n is not None:
        index = kwargs.get("index", 0)
        for p in p1:
            words = [w for w in re.split(r"\s", p.text.split("\t")[index]) if w.strip()]
            if len(words) != n:
                return 0.0
    sec = docs[1].sections[0]
    width = sec.page_width - sec.left_margin - sec.right_margin
    ignore = lambda t: (
        t.alignment == WD_TAB_ALIGNMENT.CLEAR
        or (  # noqa: E731
            t.alignment == WD_TAB_ALIGNMENT.LEFT and t.position == 0
        )
    )
    minus = 0.0
    for a, b in zip(p1, p2, strict=True):
        t1 = [t for t in a.paragraph_format.tab_stops if not ignore(t)]
        t2 = [t for t in b.paragraph_format.tab_stops if not ignore(t)]
        if len(t1) != len(t2):
            return 0.0
        diff = 0.0
        for x, y in zip(t1, t2, strict=True):
            if x.alignment != y.alignment:
                return 0.0
            diff += abs(x.position - y.position)
        minus += diff / width
    return 1.0 - minus / len(p1)


def _delta_e(rgb1: Sequence[int], rgb2: Sequence[int]) -> float:
    from skimage.color import deltaE_ciede2000, rgb2lab

    lab1 = rgb2lab([c / 255.0 for c in rgb1[:3]])
    lab2 = rgb2lab([c / 255.0 for c in rgb2[:3]])
    return float(deltaE_ciede2000(lab1, lab2))


@METRICS.register("evaluate_colored_words_in_tables")
def evaluate_colored_words_in_tables(file1: str | None, file2: str | None, **kwargs: Any) -> float:
    """1 iff the texts match and every table word starting with a vowel is red, every other
    word blue (CIEDE2000 distance at most ``threshold``, default 3.5).
    """  # noqa: D205
    if not file1 or not file2 or not compare_docx_files(file1, file2):
        return 0.0
    d = _docx(file1)
    threshold = kwargs.get("threshold", 3.5)
    for table in d.tables:
        for row in table.rows:
            for cell in row.cells:
                for p in cell.paragraphs:
                    for r in p.runs:
                        if not r.text:
                            continue
                        want = (255, 0, 0) if r.text[0].lower() in "aeiou" else (0, 0, 255)
                        if _delta_e(r.font.color.rgb, want) > threshold:
                            return 0.0
    return 1.0


@METRICS.register("check_highlighted_words")
def check_highlighted_words(file1: str | None, file2: str | None) -> float:
    """1 iff the texts match and no span of the (ODT) result is highlighted yellow (#ffff00)."""
    from odf.opendocument import load
    from odf.text import Span

    if not file1 or not file2 or not compare_docx_files(file1, file2):
        return 0.0
    doc = load(file1)
    styles = {s.getAttribute("name"): s for s in doc.automaticstyles.childNodes}
    for span in doc.getElementsByType(Span):
        style = styles.get(span.getAttribute("stylename") or "")
        if style is not None and any(
            prop.getAttribute("backgroundcolor") == "#ffff00" for prop in style.childNodes
        ):
            return 0.0
    return 1.0


@METRICS.register("evaluate_strike_through_last_paragraph")
def evaluate_strike_through_last_paragraph(file1: str | None, file2: str | None) -> float:
    """1 iff the texts match and every run of the last paragraph is struck through."""
    if not file1 or not file2 or not compare_docx_files(file1, file2):
        return 0.0
    try:
        last = _docx(file1).paragraphs[-1]
    except Exception:  # noqa: BLE001
        return 0.0
    return float(all(r.font.strike for r in last.runs))


@METRICS.register("check_italic_font_size_14")
def check_italic_font_size_14(file1: str | None, file2: str | None) -> float:
    """1 iff the texts match and every italic run is 14 pt."""
    if not file1 or not file2 or not compare_docx_files(file1, file2):
        return 0.0
    try:
        d = _docx(file1)
    except Exception:  # noqa: BLE001
        return 0.0
    for p in d.paragraphs:
        for r in p.runs:
            if r.italic and (r.font.size is None or r.font.size.pt != 14):
                return 0.0
    return 1.0


@METRICS.register("contains_page_break")
def contains_page_break(file: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the body's runs hold a page break (exactly ``rules["page_break_count"]`` if given)."""
    if not file:
        return 0.0
    try:
        d = _docx(file)
    except Exception:  # noqa: BLE001
        return 0.0
    want = rules.get("page_break_count") if isinstance(rules, Mapping) else None
    count = sum(
        1
        for p in d.paragraphs
        for r in p.runs
        for br in r.element.iter(f"{{{_W}}}br")
        if br.get(f"{{{_W}}}type") == "page"
    )
    if want is not None and count != want:
        return 0.0
    return float(count > 0)


@METRICS.register("find_default_font")
def find_default_font(config_file: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff Writer's default font (``registrymodifications.xcu``) is ``rules["font_name"]``."""
    if not config_file:
        return 0.0
    font = None
    try:
        root = parse_xml_file(config_file)
        path = "/org.openoffice.Office.Writer/DefaultFont"
        for item in root.iterfind(f".//item[@{{{_OOR}}}path='{path}']"):
            for prop in item.iterfind(f".//prop[@{{{_OOR}}}name='Standard']"):
                for value in prop.iterfind("value"):
                    font = value.text
    except (OSError, etree.XMLSyntaxError):
        pass
    return float(font == rules["font_name"])


@METRICS.register("compare_references")
def compare_references(file1: str | None, file2: str | None, **options: Any) -> float:
    """Fuzzy match of the reference lists after ``reference_indicator`` (default "References").

    1 when neither document has the heading, 0 when one lacks it or the item counts differ;
    else the mean rapidfuzz ratio ``r`` per item rescaled above ``reference_base_result`` (b,
    default 0.5): ``(r - b) / (1 - b)`` when ``r >= b + 0.01``, else 0.
    """
    if not file1 or not file2 or not (file1.endswith(".docx") and file2.endswith(".docx")):
        return 0.0
    docs = _both(file1, file2)
    if docs is None:
        return 0.0
    head = options.get("reference_indicator", "References")
    base = options.get("reference_base_result", 0.5)
    p1 = [p.text for p in docs[0].paragraphs]
    p2 = [p.text for p in docs[1].paragraphs]
    i1 = p1.index(head) if head in p1 else -1
    i2 = p2.index(head) if head in p2 else -1
    if i1 == -1 and i2 == -1:
        return 1.0
    if i1 == -1 or i2 == -1:
        return 0.0
    r1 = [p for p in p1[i1 + 1 :] if p.strip()]
    r2 = [p for p in p2[i2 + 1 :] if p.strip()]
    if len(r1) != len(r2):
        return 0.0
    mean = sum(_ratio(a, b) for a, b in zip(r1, r2, strict=True)) / len(r1)
    return (mean - base) / (1 - base) if mean >= base + 0.01 else 0.0


def _lines_and_ids(path: str) -> tuple[list[str], list[str]] | None:
    try:
        lines = [p.text.strip() for p in _docx(path).paragraphs if p.text.strip()]
    except Exception:  # noqa: BLE001
        return None
    ids = [ln.split(",")[1].strip() for ln in lines if len(ln.split(",")) == 4]
    return lines, ids


@METRICS.register("compare_unique_train_records")
def compare_unique_train_records(processed: str | None, expected: Any, **kwargs: Any) -> float:
    """1 iff the de-duplicated train log keeps only lines of the original, one per train id, the
    gold file's ids and line count (``expected`` = [gold docx, original docx]).
    """  # noqa: D205
    if not processed or not isinstance(expected, list) or len(expected) < 2:
        return 0.0
    gold, initial = expected[0], expected[1]
    if not gold or not initial:
        return 0.0
    got, g, i = _lines_and_ids(processed), _lines_and_ids(gold), _lines_and_ids(initial)
    if got is None or g is None or i is None:
        return 0.0
    lines, ids = got
    ok = (
        set(lines) <= set(i[0])
        and len(ids) == len(set(ids))
        and set(ids) == set(g[1])
        and len(lines) == len(g[0])
    )
    return float(ok)


@METRICS.register("fuzzy_place_math")
def fuzzy_place_math(file: str | None, rules: Mapping[str, Any]) -> float:
    """Mean, over the document's words, of the best rapidfuzz ratio against the accepted answers;
    0 unless the document holds exactly three words.
    """  # noqa: D205
    if file is None:
        return 0.0
    words = [w for p in _docx(file).paragraphs for w in p.text.split()]
    scores = [max([_ratio(w, a) for a in rules["expected"]], default=0.0) for w in words]
    return sum(scores) / 3 if len(scores) == 3 else 0.0

"""Document metrics (upstream ``metrics/docs.py``) on DOCX/ODT files from the fixture source."""

import pytest
from docx.enum.text import WD_ALIGN_PARAGRAPH, WD_BREAK
from docx.shared import Pt, RGBColor

from osworld_jax.env.evaluators import METRICS


def m(name):
    return METRICS.get(name)


def paras(*texts, **run_fmt):
    def build(d):
        for t in texts:
            r = d.add_paragraph().add_run(t)
            for k, v in run_fmt.items():
                setattr(r.font, k, v)

    return build


def test_compare_docx_files_options(src):
    f = m("compare_docx_files")
    gold = src.docx("g.docx", paras("Hello  world", "Second line"))
    assert f(src.docx("a.docx", paras("Hello world", "Second line")), gold) == 1.0  # blanks
    assert (
        f(src.docx("b.docx", paras("Hello world", "Second line")), gold, ignore_blanks=False) == 0.0
    )
    upper = src.docx("c.docx", paras("HELLO world", "Second line"))
    assert f(upper, gold) == 0.0
    assert f(upper, gold, ignore_case=True) == 1.0
    swapped = src.docx("d.docx", paras("Second line", "Hello  world"))
    assert f(swapped, gold) == 0.0
    assert f(swapped, gold, ignore_order=True) == 1.0
    # fuzzy: rapidfuzz ratio of "Hello world Second lin" vs "Hello world Second line" = 44/45
    short = src.docx("e.docx", paras("Hello world", "Second lin"))
    assert f(short, gold, fuzzy_match=True) == pytest.approx(44 / 45)
    assert f(short, gold, content_only=True) == pytest.approx(44 / 45)
    blank = src.docx("h.docx", paras("Hello  world", "", "Second line"))
    assert f(blank, gold, ignore_blanks=False) == 0.0
    assert f(blank, gold, ignore_blanks=False, delete_empty_lines=True) == 1.0
    assert f(None, gold) == 0.0
    assert f(src.odt("x.odt", ["Hello world"]), gold) == 0.0  # type mismatch
    assert f(src.odt("o1.odt", ["A", "B"]), src.odt("o2.odt", ["A", "B"])) == 1.0
    assert f(src.odt("o3.odt", ["A", "C"]), src.odt("o2.odt", ["A", "B"])) == 0.0
    assert m("compare_docx_files_and_ignore_new_lines")(blank, gold) == 1.0
    assert m("compare_docx_files_and_ignore_new_lines")(upper, gold) == 0.0


def _table(rows, bold_first=False):
    def build(d):
        d.add_paragraph("Intro")
        t = d.add_table(rows=len(rows), cols=len(rows[0]))
        for i, row in enumerate(rows):
            for j, v in enumerate(row):
                t.cell(i, j).text = v

    return build


def test_compare_docx_tables(src):
    f = m("compare_docx_tables")
    gold = src.docx("g.docx", _table([["a", "b"], ["1", "2"]]))
    assert f(src.docx("r.docx", _table([["a ", "b"], ["1", "2"]])), gold) == 1.0  # stripped
    assert f(src.docx("w.docx", _table([["a", "b"], ["1", "3"]])), gold) == 0.0
    assert f(src.docx("s.docx", _table([["a", "b"]])), gold) == 0.0


def test_compare_docx_images(src):
    from PIL import Image

    red = src.image("red.png", lambda: Image.new("RGB", (8, 8), (255, 0, 0)))
    blue = src.image("blue.png", lambda: Image.new("RGB", (8, 8), (0, 0, 255)))

    def pic(path):
        return lambda d: d.add_picture(path)

    f = m("compare_docx_images")
    assert f(src.docx("a.docx", pic(red)), src.docx("b.docx", pic(red))) == 1.0
    assert f(src.docx("c.docx", pic(blue)), src.docx("b.docx", pic(red))) == 0.0
    assert f(src.docx("n.docx", paras("x")), src.docx("b.docx", pic(red))) == 0.0


def test_line_spacing_font_names_subscript(src):
    def spaced(s):
        def build(d):
            for t in ("a", "b"):
                d.add_paragraph(t).paragraph_format.line_spacing = s

        return build

    f = m("compare_line_spacing")
    assert f(src.docx("a.docx", spaced(2.0)), src.docx("b.docx", spaced(2.0))) == 1.0
    assert f(src.docx("c.docx", spaced(1.5)), src.docx("b.docx", spaced(2.0))) == 0.0
    g = m("compare_font_names")
    assert (
        g(
            src.docx("t.docx", paras("x", "y", name="Times New Roman")),
            {"font_name": "Times New Roman"},
        )
        == 1.0
    )
    assert g(src.docx("u.docx", paras("x", name="Arial")), {"font_name": "Times New Roman"}) == 0.0
    s = m("compare_subscript_contains")
    sub = src.docx("s.docx", paras("H2O", subscript=True))
    assert s(sub, src.docx("s2.docx", paras("H2O", subscript=True))) == 1.0
    assert s(src.docx("p.docx", paras("H2O")), sub) == 0.0


def test_footer_centered_tabstops(src):
    def footer(text):
        def build(d):
            d.add_paragraph("body")
            d.sections[0].footer.paragraphs[0].text = text

        return build

    f = m("has_page_numbers_in_footers")
    assert f(src.docx("a.docx", footer("Page 1"))) == 1.0
    assert f(src.docx("b.docx", footer("Page"))) == 0.0

    def first(align):
        def build(d):
            d.add_paragraph("Title").alignment = align
            d.add_paragraph("text")

        return build

    c = m("is_first_line_centered")
    assert c(src.docx("c.docx", first(WD_ALIGN_PARAGRAPH.CENTER))) == 1.0
    assert c(src.docx("l.docx", first(WD_ALIGN_PARAGRAPH.LEFT))) == 0.0

    def tabs(pos_pt):
        def build(d):
            for t in ("Name\tValue", "Longer name\tOther"):
                p = d.add_paragraph(t)
                p.paragraph_format.tab_stops.add_tab_stop(Pt(pos_pt))

        return build

    t = m("check_tabstops")
    gold = src.docx("g.docx", tabs(200))
    assert t(src.docx("s.docx", tabs(200)), gold) == 1.0
    # 10 pt off in both paragraphs over a 6 in (432 pt) text width: 1 - 10/432
    assert t(src.docx("o.docx", tabs(210)), gold) == pytest.approx(1 - 10 / 432)
    assert (
        t(src.docx("s2.docx", tabs(200)), gold, word_number_split_by_tabstop=1) == 0.0
    )  # "Longer name"
    assert t(src.docx("n.docx", paras("Name\tValue")), gold) == 0.0


def test_colored_words_strike_italic(src):
    def colored(vowel_rgb):
        def build(d):
            t = d.add_table(rows=1, cols=2)
            for cell, word in zip(t.rows[0].cells, ("apple", "pear"), strict=True):
                r = cell.paragraphs[0].add_run(word)
                r.font.color.rgb = RGBColor(*(vowel_rgb if word[0] in "aeiou" else (0, 0, 255)))

        return build

    f = m("evaluate_colored_words_in_tables")
    gold = src.docx("g.docx", colored((255, 0, 0)))
    assert f(src.docx("r.docx", colored((254, 0, 0))), gold) == 1.0  # a near red
    assert f(src.docx("w.docx", colored((0, 128, 0))), gold) == 0.0

    def strike(last_struck):
        def build(d):
            d.add_paragraph("keep")
            p = d.add_paragraph()
            p.add_run("old ").font.strike = True
            p.add_run("text").font.strike = last_struck

        return build

    s = m("evaluate_strike_through_last_paragraph")
    assert s(src.docx("s.docx", strike(True)), src.docx("sg.docx", strike(True))) == 1.0
    assert s(src.docx("n.docx", strike(False)), src.docx("sg.docx", strike(True))) == 0.0

    def italic(size):
        def build(d):
            r = d.add_paragraph().add_run("emph")
            r.italic, r.font.size = True, Pt(size)

        return build

    i = m("check_italic_font_size_14")
    assert i(src.docx("i.docx", italic(14)), src.docx("ig.docx", italic(14))) == 1.0
    assert i(src.docx("j.docx", italic(12)), src.docx("ig.docx", italic(12))) == 0.0


def test_page_break_default_font_references(src):
    def breaks(n):
        def build(d):
            for i in range(n):  # one page of text each (LibreOffice makes two breaks in a row
                d.add_paragraph(f"page {i}").add_run().add_break(WD_BREAK.PAGE)  # into one)
            d.add_paragraph("end")  # (and drops a break that nothing follows)

        return build

    f = m("contains_page_break")
    assert f(src.docx("b.docx", breaks(1)), {}) == 1.0
    assert f(src.docx("n.docx", breaks(0)), {}) == 0.0
    assert f(src.docx("t.docx", breaks(2)), {"page_break_count": 1}) == 0.0
    xcu = (
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry">'
        '<item oor:path="/org.openoffice.Office.Writer/DefaultFont">'
        '<prop oor:name="Standard" oor:op="fuse"><value>Times New Roman</value></prop></item>'
        "</oor:items>"
    )
    g = m("find_default_font")
    p = src.text("r.xcu", xcu)
    assert g(p, {"font_name": "Times New Roman"}) == 1.0
    assert g(p, {"font_name": "Arial"}) == 0.0
    r = m("compare_references")
    refs = lambda *items: paras("Body", "References", *items)  # noqa: E731
    gold = src.docx("rg.docx", refs("[1] A. Author. Title. 2020.", "[2] B. Writer. Book. 2021."))
    same = src.docx("rs.docx", refs("[1] A. Author. Title. 2020.", "[2] B. Writer. Book. 2021."))
    assert r(same, gold) == 1.0
    assert r(src.docx("rf.docx", refs("[1] A. Author. Title. 2020.")), gold) == 0.0
    assert r(src.docx("rn.docx", paras("Body")), gold) == 0.0


def test_unique_train_records_and_fuzzy_place_math(src):
    lines = ["08:00:00, T1, S1, 1", "08:05:00, T2, S1, 2", "08:10:00, T1, S2, 1"]
    initial = src.docx("i.docx", paras(*lines))
    gold = src.docx("g.docx", paras(lines[0], lines[1]))
    f = m("compare_unique_train_records")
    assert f(src.docx("p.docx", paras(lines[0], lines[1])), [gold, initial]) == 1.0
    assert f(src.docx("d.docx", paras(*lines)), [gold, initial]) == 0.0  # duplicate T1
    assert f(src.docx("x.docx", paras(lines[0], "09:00:00, T2, S9, 3")), [gold, initial]) == 0.0
    assert f(src.docx("q.docx", paras(lines[0])), gold) == 0.0  # needs [gold, initial]
    g = m("fuzzy_place_math")
    three = src.docx("t.docx", paras("Paris", "Rome Berlin"))
    assert g(three, {"expected": ["Paris", "Rome", "Berlin"]}) == 1.0
    assert g(src.docx("u.docx", paras("Paris Rome")), {"expected": ["Paris", "Rome"]}) == 0.0


def test_check_highlighted_words_odt(src):
    from odf.opendocument import OpenDocumentText
    from odf.style import Style, TextProperties
    from odf.text import P, Span

    def odt(name, highlight):
        doc = OpenDocumentText()
        style = Style(name="T1", family="text")
        style.addElement(TextProperties(backgroundcolor="#ffff00" if highlight else "transparent"))
        doc.automaticstyles.addElement(style)
        p = P(text="Remember ")
        p.addElement(Span(stylename=style, text="this"))
        doc.text.addElement(p)
        path = src.path(name)
        doc.save(str(path))
        return str(path)

    f = m("check_highlighted_words")
    gold = odt("g.odt", False)
    assert f(odt("clean.odt", False), gold) == 1.0  # highlight removed
    assert f(odt("marked.odt", True), gold) == 0.0  # still highlighted yellow
    assert f(src.odt("other.odt", ["Forget this"]), gold) == 0.0  # text changed

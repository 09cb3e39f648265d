"""PDF, archive, EPUB, HTML, source-file and settings metrics (upstream ``chrome.py``,
``pdf.py``, ``others.py``, ``vscode.py``, ``general.py``)."""

import json
import shutil
import zipfile

import pytest
from PIL import Image

from osworld_jax.env.evaluators import METRICS


def m(name):
    return METRICS.get(name)


def test_compare_pdfs_and_page_count(src):
    f = m("compare_pdfs")
    a = src.pdf("a.pdf", [{"lines": ["Invoice 42", "Total: 100 EUR"]}, {"lines": ["Thanks"]}])
    b = src.pdf("b.pdf", [{"lines": ["Invoice 42", "Total: 100 EUR"]}, {"lines": ["Thanks"]}])
    c = src.pdf("c.pdf", [{"lines": ["Invoice 42", "Total: 900 EUR"]}, {"lines": ["Thanks"]}])
    assert f(a, b) == 1.0
    # one character of "Invoice 42\nTotal: 100 EUR\nThanks" (32) differs: indel ratio 62/64
    assert f(c, b) == pytest.approx(62 / 64)
    assert f([a, c], [b, b]) == pytest.approx((1 + 62 / 64) / 2)
    broken = src.text("x.pdf", "not a pdf")
    assert f(broken, b) == 0.0
    g = m("check_pdf_pages")
    assert g(a, {"relation": "eq", "ref_value": 2}) == 1.0
    assert g(a, {"relation": "eq", "ref_value": 1}) == 0.0
    assert g(None, {"relation": "eq", "ref_value": 1}) == 0.0


def test_compare_pdf_images(src):
    import numpy as np

    def noise(seed):  # textured images: their perceptual hashes differ by ~28 bits
        return Image.fromarray((np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8"))

    red, stripes = Image.new("RGB", (32, 32), (220, 20, 20)), noise(0)
    f = m("compare_pdf_images")
    gold = src.pdf("g.pdf", [{"lines": ["receipt"], "images": [stripes]}])
    assert f(src.pdf("a.pdf", [{"lines": ["other text"], "images": [stripes]}]), gold) == 1.0
    assert f(src.pdf("b.pdf", [{"lines": ["receipt"], "images": [noise(1)]}]), gold) == 0.0
    assert f(src.pdf("c.pdf", [{"lines": ["receipt"], "images": [stripes, red]}]), gold) == 0.0
    assert f(src.pdf("d.pdf", [{"lines": ["x"]}]), src.pdf("e.pdf", [{"lines": ["y"]}])) == 1.0
    assert f(None, gold) == 0.0


def test_compare_archive(src, tmp_path):
    def archive(name, files, fmt="zip"):
        root = tmp_path / f"{name}_src"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        return shutil.make_archive(str(tmp_path / name), fmt, root)

    f = m("compare_archive")
    gold = archive("gold", {"notes/a.txt": "alpha", "notes/b.txt": "beta"})
    assert (
        f(
            archive("p1", {"notes/a.txt": "alpha", "notes/b.txt": "beta"}, "gztar"),
            gold,
            file_path="notes",
        )
        == 1.0
    )
    assert (
        f(archive("p2", {"notes/a.txt": "alpha", "notes/b.txt": "BETA"}), gold, file_path="notes")
        == 0.5
    )
    assert f(archive("p3", {"notes/a.txt": "alpha"}), gold, file_path="notes") == 0.0
    p4 = archive("p4", {"notes/a.txt": "alpha", "notes/b.txt": "beta"})
    with pytest.raises(ValueError, match="hologram"):
        f(p4, gold, file_path="notes", file_type="hologram")
    assert f(None, gold) == 0.0


def test_compare_zip_files(tmp_path, src):
    def z(name, entries):
        p = tmp_path / name
        with zipfile.ZipFile(p, "w") as zf:
            for k, v in entries.items():
                zf.writestr(k, v)
        return str(p)

    pdf = open(src.pdf("e.pdf", [{"lines": ["Essay text"]}]), "rb").read()
    f = m("compare_zip_files")
    gold = z("g.zip", {"essay.pdf": pdf, "readme.txt": "hi"})
    assert f(z("a.zip", {"essay.pdf": pdf, "readme.txt": "hi"}), gold) == 1.0
    assert f(z("b.zip", {"essay.pdf": pdf, "readme.txt": "ho"}), gold) == 0.0
    assert f(z("c.zip", {"essay.pdf": pdf}), gold) == 0.0


def test_compare_htmls(src):
    f = m("compare_htmls")
    gold = src.text(
        "g.html", '<html><body><table><tr><td sdnum="1033;">5</td></tr></table></body></html>'
    )
    same = src.text(
        "s.html", '<html><body><table><tr><td sdnum="1033;0;0.00">5</td></tr></table></body></html>'
    )
    assert f(same, gold) == 0.0  # the sdnum attribute differs
    assert f(same, gold, ignore_sdnum=True) == 1.0
    other = src.text(
        "o.html", '<html><body><table><tr><td sdnum="1033;">6</td></tr></table></body></html>'
    )
    assert f(other, gold, ignore_sdnum=True) == 0.0


def test_compare_epub(tmp_path):
    def epub(name, chapter):
        p = tmp_path / name
        with zipfile.ZipFile(p, "w") as z:
            z.writestr(
                "content.opf",
                '<package>\n<dc:identifier id="u">urn:uuid:1</dc:identifier>\n'
                "<title>Book</title>\n</package>\n",
            )
            z.writestr("toc.ncx", "<ncx>\n<navPoint id='1'/>\n<docTitle>Book</docTitle>\n</ncx>\n")
            z.writestr("chapter1.html", f"<html><body><p>{chapter}</p></body></html>")
        return str(p)

    f = m("compare_epub")
    gold = epub("g.epub", "Call me Ishmael.")
    assert f(epub("a.epub", "Call me Ishmael."), gold) == 1.0
    # the chapter pretty-prints to one line, which differs: ratio 0 for it, 1 for the
    # identifier-free content.opf and navPoint-free toc.ncx: (1 + 1 + 0) / 3
    assert f(epub("b.epub", "Call me Bob."), gold) == pytest.approx(2 / 3)
    assert f(None, gold) == 0.0


def test_result_and_python_files(src):
    f = m("compare_result_files")
    gold = src.text("g.txt", "3.14159\n")
    assert f(src.text("a.txt", "The answer is 3.14159"), gold) == 1.0
    assert f(src.text("b.txt", "3.14160"), gold) == 1.0  # within 1e-4
    assert f(src.text("c.txt", "3.15"), gold) == 0.0
    assert f(src.text("d.txt", "done"), src.text("e.txt", "done\n")) == 1.0
    g = m("compare_python_pure_text")
    gold_py = src.text("g.py", "import os\n\ndef f():\n    return 1\n")
    assert (
        g(src.text("a.py", "#!/usr/bin/env python3\nimport os\ndef f():\n\treturn 1   \n"), gold_py)
        == 1.0
    )
    assert (
        g(src.text("b.py", "```python\nimport os\ndef f():\n    return 1\n```\n"), gold_py) == 0.0
    )


def test_compare_config_and_extension(src):
    f = m("compare_config")
    settings = src.text(
        "s.json", json.dumps({"workbench.colorTheme": "Visual Studio Dark", "x": 1})
    )
    want = {"expected": '{"workbench.colorTheme": "Visual Studio Dark"}\n'}
    assert f(settings, want) == 1.0  # a subset of the file's JSON
    assert f(settings, {"expected": '{"workbench.colorTheme": "Light"}'}) == 0.0
    assert f(settings, want, containment_ok=False) == 0.0
    assert f(src.text("p.txt", "project\n"), {"expected": "project"}) == 1.0  # substring
    g = m("is_extension_installed")
    assert g("mattn.lisp\n", {"type": "contain", "expected": "mattn.lisp"}) == 1.0
    assert g("", {"type": "contain", "expected": "mattn.lisp"}) == 0.0
    assert g("", {"type": "not_contain", "expected": "mattn.lisp"}) == 1.0


def test_agent_archives_cannot_write_outside_their_directory(tmp_path):
    # The agent makes the archive; the host unpacks it. A member "../x" or a symlink out of the
    # directory must not write on the host: such an archive scores 0 and nothing is written.
    import io
    import tarfile

    f = m("compare_archive")
    gold_dir = tmp_path / "g"
    (gold_dir / "notes").mkdir(parents=True)
    (gold_dir / "notes" / "a.txt").write_text("alpha")
    gold = shutil.make_archive(str(tmp_path / "gold"), "zip", gold_dir)
    outside = tmp_path / "outside.txt"

    tar_path = tmp_path / "evil.tar.gz"
    with tarfile.open(tar_path, "w:gz") as t:
        data = b"pwned"
        info = tarfile.TarInfo("notes/../../outside.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    assert f(str(tar_path), gold, file_path="notes") == 0.0
    link_path = tmp_path / "link.tar"
    with tarfile.open(link_path, "w") as t:
        info = tarfile.TarInfo("notes/a.txt")
        info.type, info.linkname = tarfile.SYMTYPE, str(outside)
        t.addfile(info)
    assert f(str(link_path), gold, file_path="notes") == 0.0
    zip_path = tmp_path / "evil.zip"
    with zipfile.ZipFile(zip_path, "w") as z:
        z.writestr("notes/a.txt", "alpha")
        z.writestr("../outside.txt", "pwned")
    assert f(str(zip_path), gold, file_path="notes") == 0.0
    assert not outside.exists()
    # an EPUB chapter named "../x.html" is skipped, not written beside the book's directory
    book = tmp_path / "b.epub"
    with zipfile.ZipFile(book, "w") as z:
        z.writestr("../escape.html", "<html><body>x</body></html>")
    assert m("compare_epub")(str(book), str(book)) == 0.0
    assert not (tmp_path / "escape.html").exists()


@pytest.mark.parametrize(
    "entity",
    [
        '<!ENTITY x SYSTEM "file://{secret}">',  # a host file pulled into a compared value
        '<!ENTITY a "Times "><!ENTITY b "New "><!ENTITY x "&a;&b;Roman">',  # nested expansion
    ],
)
def test_agent_xml_entities_are_not_expanded(src, tmp_path, entity):
    # A settings file the agent wrote is parsed on the host: its entities are not expanded
    # (lxml's default parser would expand the internal ones into "Times New Roman").
    secret = tmp_path / "secret.txt"
    secret.write_text("Times New Roman")
    xcu = src.text(
        "registrymodifications.xcu",
        f'<?xml version="1.0"?><!DOCTYPE oor:items [{entity.format(secret=secret)}]>'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry">'
        '<item oor:path="/org.openoffice.Office.Writer/DefaultFont">'
        '<prop oor:name="Standard" oor:op="fuse"><value>&x;</value></prop></item></oor:items>',
    )
    assert m("find_default_font")(xcu, {"font_name": "Times New Roman"}) == 0.0

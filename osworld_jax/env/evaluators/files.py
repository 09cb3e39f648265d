"""File metrics: PDFs, archives, EPUB, HTML, result and source files, editor settings.

Follows upstream ``desktop_env/evaluators/metrics`` ``chrome.py`` (``compare_pdfs``,
``compare_pdf_images``, ``compare_archive``, ``compare_htmls``), ``pdf.py``, ``others.py``
(``compare_epub``), ``vscode.py`` and ``general.py`` (``compare_python_pure_text``).

Deliberate difference: upstream extracts PDF text and images with PyMuPDF (AGPL); we use
pdfplumber (text) and pypdf (images), so ``compare_pdfs`` of two PDFs whose texts differ can give
a slightly different partial score (identical texts still score 1). See ``docs/EVALUATORS.md``.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import read_text


def _ratio(a: str, b: str) -> float:
    from rapidfuzz import fuzz

    return float(fuzz.ratio(a, b)) / 100.0


def pdf_text(path: str) -> str:
    """The text of every page, each ending in a newline (as PyMuPDF's ``get_text`` does),
    concatenated and stripped (pdfplumber).
    """  # noqa: D205
    import pdfplumber

    with pdfplumber.open(path) as pdf:
        return "".join((page.extract_text() or "") + "\n" for page in pdf.pages).strip()


@METRICS.register("compare_pdfs")
def compare_pdfs(pdf1: Any, pdf2: Any) -> float:
    """Mean rapidfuzz ratio of the texts of paired PDFs (one pair, or parallel lists).

    A pair that cannot be read adds 0.
    """
    if not isinstance(pdf2, list):
        pdf1, pdf2 = [pdf1], [pdf2]
    score = 0.0
    for a, b in zip(pdf1, pdf2, strict=False):
        try:
            score += _ratio(pdf_text(a), pdf_text(b))
        except Exception:  # noqa: BLE001 - upstream logs an unreadable pair and adds 0
            continue
    return score / len(pdf2)


def _pdf_images(path: str) -> list[Any]:
    from PIL import Image
    from pypdf import PdfReader

    out = []
    for page in PdfReader(path).pages:
        for img in page.images:
            try:
                out.append(Image.open(io.BytesIO(img.data)))
            except Exception:  # noqa: BLE001 - upstream skips an image it cannot decode
                continue
    return out


@METRICS.register("compare_pdf_images")
def compare_pdf_images(pdf1: str | None, pdf2: str | None, **kwargs: Any) -> float:
    """Fraction of paired embedded images whose perceptual hashes differ by at most 5.

    Different image counts score 0; no images in either PDF scores 1.
    """
    import imagehash

    if not pdf1 or not pdf2 or not (os.path.exists(pdf1) and os.path.exists(pdf2)):
        return 0.0
    try:
        i1, i2 = _pdf_images(pdf1), _pdf_images(pdf2)
    except Exception:  # noqa: BLE001 - unreadable PDFs: 0, as upstream
        return 0.0
    if len(i1) != len(i2):
        return 0.0
    if not i1:
        return 1.0
    close = sum(
        int(imagehash.phash(a) - imagehash.phash(b) <= 5) for a, b in zip(i1, i2, strict=True)
    )
    return close / len(i1)


@METRICS.register("check_pdf_pages")
def check_pdf_pages(pdf: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff ``operator.<relation>(page count, ref_value)`` holds."""
    import operator

    from pypdf import PdfReader

    if pdf is None:
        return 0.0
    pages = len(PdfReader(pdf).pages)
    return float(getattr(operator, rules["relation"])(pages, rules["ref_value"]))


# What an agent-made archive may unpack to on the host (members and total), in bytes.
MAX_UNPACKED_BYTES = 2 << 30


def safe_unpack(archive: str, dest: str) -> None:
    """``shutil.unpack_archive`` for untrusted archives: members stay inside ``dest``.

    Zip members with absolute paths or ``..`` are refused (as tar members, links and devices
    are by tarfile's ``data`` filter), and the unpacked size is capped at
    ``MAX_UNPACKED_BYTES``.

    Raises:
      ValueError: a member would leave ``dest`` or the archive unpacks too large.
    """
    import tarfile

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            infos = z.infolist()
            for info in infos:
                parts = Path(info.filename).parts
                if info.filename.startswith("/") or ".." in parts:
                    raise ValueError(f"{archive}: member {info.filename!r} leaves the archive")
            if sum(i.file_size for i in infos) > MAX_UNPACKED_BYTES:
                raise ValueError(f"{archive}: unpacks to more than {MAX_UNPACKED_BYTES} bytes")
            z.extractall(dest)
        return
    if not hasattr(tarfile, "data_filter"):  # Python < 3.11.4
        raise ValueError("unpacking tar archives safely needs Python 3.11.4 or newer")
    with tarfile.open(archive) as t:
        members = t.getmembers()
        if sum(m.size for m in members) > MAX_UNPACKED_BYTES:
            raise ValueError(f"{archive}: unpacks to more than {MAX_UNPACKED_BYTES} bytes")
        try:
            t.extractall(dest, filter="data")
        except tarfile.FilterError as e:
            raise ValueError(f"{archive}: {e}") from e


def _archive_compare(file_type: str) -> Callable[..., float]:
    names = {
        "text": "compare_text_file", "pdf": "compare_pdfs", "docx": "compare_docx_files",
        "ppt": "compare_pptx_files", "image": "compare_images", "csv": "compare_csv",
        "table": "compare_table", "audio": "compare_audios", "video": "compare_videos",
    }  # fmt: skip
    if file_type not in names:
        raise ValueError(f"compare_archive: file_type {file_type!r} is not supported")
    return METRICS.get(names[file_type])


@METRICS.register("compare_archive")
def compare_archive(pred: str | None, gold: str, **kwargs: Any) -> float:
    """Unpacks both archives; the same file names under ``file_path`` (default the root), and
    the mean of the ``file_type`` metric (default ``text``) over the paired files.
    """  # noqa: D205
    if not pred:
        return 0.0
    opts = dict(kwargs)
    sub = opts.pop("file_path", "")
    file_type = opts.pop("file_type", "text")
    pred_dir = os.path.splitext(pred)[0] + "_pred"
    gold_dir = os.path.splitext(gold)[0] + "_gold"
    shutil.rmtree(pred_dir, ignore_errors=True)
    os.makedirs(pred_dir)
    try:
        safe_unpack(pred, pred_dir)
    except (ValueError, OSError, zipfile.BadZipFile):
        return 0.0  # an archive that is unreadable or escapes its directory is not the answer
    if not os.path.exists(gold_dir):
        os.makedirs(gold_dir)
        safe_unpack(gold, gold_dir)
    p_files = sorted(os.listdir(os.path.join(pred_dir, sub)))
    g_files = sorted(os.listdir(os.path.join(gold_dir, sub)))
    if p_files != g_files:
        return 0.0
    compare = _archive_compare(file_type)
    total = sum(
        compare(os.path.join(pred_dir, sub, a), os.path.join(gold_dir, sub, b), **opts)
        for a, b in zip(p_files, g_files, strict=True)
    )
    return total / len(p_files)


@METRICS.register("compare_htmls")
def compare_htmls(html1: str | None, html2: str, **options: Any) -> float:
    """1 iff the two HTML documents have the same node sequence: tag names, stripped texts and
    attributes (``ignore_sdnum`` drops LibreOffice's ``sdnum`` attribute from the comparison).
    """  # noqa: D205
    from bs4 import BeautifulSoup, Tag

    if html1 is None:
        return 0.0
    with open(html1, encoding="utf-8") as f:
        s1 = BeautifulSoup(f, "lxml")
    with open(html2, encoding="utf-8") as f:
        s2 = BeautifulSoup(f, "lxml")
    ignore = options.get("ignore_sdnum")

    def same(e1: Any, e2: Any) -> bool:
        if not (isinstance(e1, Tag) and isinstance(e2, Tag)):
            return bool(e1 == e2)
        if e1.name != e2.name or e1.text.strip() != e2.text.strip():
            return False
        if e1.attrs != e2.attrs:
            if ignore:
                drop = lambda a: {k: v for k, v in a.items() if k != "sdnum"}  # noqa: E731
                return drop(e1.attrs) == drop(e2.attrs)
            return False
        return True

    return float(all(same(a, b) for a, b in zip(s1.descendants, s2.descendants, strict=False)))


def _pdf_bytes_similar(a: bytes, b: bytes, threshold: float) -> bool:
    from pypdf import PdfReader

    text = lambda data: "".join(p.extract_text() for p in PdfReader(io.BytesIO(data)).pages)  # noqa: E731
    return difflib.SequenceMatcher(None, text(a), text(b)).ratio() >= threshold


@METRICS.register("compare_zip_files")
def compare_zip_files(actual: str | None, expected: str, **options: Any) -> float:
    """1 iff the zips hold the same names and equal contents (PDFs: text similarity >= 0.95)."""
    if not actual:
        return 0.0
    with zipfile.ZipFile(actual) as z1, zipfile.ZipFile(expected) as z2:
        names = set(z1.namelist())
        if names != set(z2.namelist()):
            return 0.0
        for name in names:
            c1, c2 = z1.read(name), z2.read(name)
            if name.lower().endswith(".pdf"):
                if not _pdf_bytes_similar(c1, c2, 0.95):
                    return 0.0
            elif c1 != c2:
                return 0.0
    return 1.0


def _epub_parts(path: str) -> list[str]:
    """Upstream ``process_epub``: toc.ncx without navPoint lines, content.opf without
    dc:identifier lines, each .html pretty-printed, written beside the book; sorted paths.

    Members named with an absolute path or ``..`` are skipped (upstream would write them
    outside the book's directory).
    """  # noqa: D205
    import lxml.html

    base = path + ".dir"
    os.makedirs(base, exist_ok=True)
    out = []
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            for name, drop in (("toc.ncx", "navPoint"), ("content.opf", "dc:identifier")):
                if name in names:
                    lines = z.read(name).decode().splitlines()
                    target = os.path.join(base, name)
                    with open(target, "w") as f:
                        f.writelines(ln + "\n" for ln in lines if drop not in ln)
                    out.append(target)
            for name in names:
                if (
                    name.endswith(".html")
                    and not name.startswith("/")
                    and ".." not in name.split("/")
                ):
                    raw = "".join(ch for ch in z.read(name).decode() if ch not in "\r\n")
                    html = lxml.html.fromstring(raw.encode())
                    target = os.path.join(base, name)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "w") as f:
                        f.write(lxml.html.tostring(html, pretty_print=True, encoding="unicode"))
                    out.append(target)
    except zipfile.BadZipFile:
        return []
    return sorted(out)


@METRICS.register("compare_epub")
def compare_epub(result: str | None, expected: str) -> float:
    """Mean line-diff ratio (``diff_text_file``) over the books' paired normalised parts."""
    if result is None:
        return 0.0
    r, e = _epub_parts(result), _epub_parts(expected)
    diff = METRICS.get("diff_text_file")
    total = sum(diff(a, b) for a, b in zip(r, e, strict=False))
    return total / len(r) if r else 0.0


@METRICS.register("compare_result_files")
def compare_result_files(src: str | None, tgt: str | None) -> float:
    """1 iff the stripped files are equal; for a numeric gold, also when the gold's text occurs
    in the result or the numbers are within 1e-4.
    """  # noqa: D205
    if not src or not tgt:
        return 0.0
    a, b = (read_text(src) or "").strip(), (read_text(tgt) or "").strip()
    try:
        gold = float(b)
        if b in a:
            return 1.0
        return float(abs(float(a) - gold) < 1e-4)
    except ValueError:
        return float(a == b)


def _pure_lines(text: str) -> str:
    lines = text.splitlines()
    i = 0
    while i < len(lines) and i < 3:
        s = lines[i].strip()
        if s.startswith(("#!", "# -*- coding:", "# coding:", "# coding=")):
            i += 1
            continue
        break
    return "\n".join(ln.expandtabs(4).rstrip() for ln in lines[i:] if ln.strip())


@METRICS.register("compare_python_pure_text")
def compare_python_pure_text(py_file: str | None, gold_file: str | None) -> float:
    """1 iff the two Python files match ignoring blank lines, trailing blanks, tab width, and a
    shebang/encoding line among the first three.
    """  # noqa: D205
    a, b = read_text(py_file), read_text(gold_file)
    if a is None or b is None:
        return 0.0
    return float(_pure_lines(a) == _pure_lines(b))


def _is_subset(want: Any, got: Any) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and all(
            k in got and _is_subset(v, got[k]) for k, v in want.items()
        )
    return bool(want == got)


@METRICS.register("compare_config")
def compare_config(actual: str | None, rules: Mapping[str, Any], **options: Any) -> float:
    """The file against ``rules["expected"]`` (text): with ``containment_ok`` (default) the
    expected JSON must be a subset of the file's JSON (or, when either is not JSON, a substring
    of the text); without, equal text or equal JSON.
    """  # noqa: D205
    if not actual:
        return 0.0
    want = rules.get("expected")
    if not want:
        return 0.0
    text = Path(actual).read_text(encoding="utf-8")
    if options.get("containment_ok", True):
        try:
            return float(_is_subset(json.loads(want), json.loads(text)))
        except ValueError:
            return float(want.strip() in text)
    if text == want:
        return 1.0
    try:
        return float(json.loads(text) == json.loads(want))
    except ValueError:
        return 0.0


@METRICS.register("is_extension_installed")
def is_extension_installed(actual: str | None, rules: Mapping[str, Any], **options: Any) -> float:
    """1 iff the command output contains (``type: contain``) or lacks (``not_contain``) the
    expected string.
    """  # noqa: D205
    if rules["type"] == "contain":
        return float(actual is not None and rules["expected"] in actual)
    if rules["type"] == "not_contain":
        return float(actual is None or rules["expected"] not in actual)
    raise ValueError(f"is_extension_installed: type {rules['type']!r} is not supported")

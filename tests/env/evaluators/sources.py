"""Where the metric tests' input files come from: a swappable fixture source.

A test describes a document (sheets and cells, paragraphs and runs, slides and shapes) and asks
the active source to write it. Two sources:

- ``LibrarySource`` (``library``) writes it with the Python libraries of each format (openpyxl,
  python-docx, python-pptx, odfpy, Pillow, a minimal PDF writer);
- ``AppsSource`` (``apps``) gives the file the real application made in a jailed local desktop
  (``osworld_jax.testing.apps.RealApps``): the library's document opened and saved again by
  LibreOffice (spreadsheets, documents, presentations; PDFs are LibreOffice's PDF export of a
  document with those pages), images opened and exported by GIMP. What a metric then reads is
  what the application wrote (LibreOffice's own XML, styles, cached formula values, GIMP's
  encoder), as in a real episode.

``conftest.py`` runs every test that takes ``src`` once per source (``apps`` only with
``--runslow`` and the apps installed: ``bash scripts/setup.sh --apps``);
``OSWORLD_JAX_FIXTURE_SOURCE=<name>`` runs only that one.

Every builder returns the written path as a ``str`` (what file getters hand to metrics).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class LibrarySource:
    """Writes fixtures with the format libraries."""

    name = "library"

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    # ------------------------------------------------------------------ text
    def text(self, name: str, content: str | bytes) -> str:
        p = self.path(name)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")
        return str(p)

    # ------------------------------------------------------------------ spreadsheets
    def xlsx(
        self,
        name: str,
        sheets: Mapping[str, Sequence[Sequence[Any]]],
        *,
        edit: Callable[[Any], None] | None = None,
    ) -> str:
        """A workbook with one sheet per entry (rows of values; ``=...`` strings are formulas).

        ``edit(workbook)`` may add styles, charts, merges, validations before saving.
        """
        import openpyxl

        wb = openpyxl.Workbook()
        wb.remove(wb.active)
        for title, rows in sheets.items():
            ws = wb.create_sheet(title)
            for r in rows:
                ws.append(list(r))
        if edit is not None:
            edit(wb)
        p = self.path(name)
        wb.save(p)
        return str(p)

    def sheet_csv(self, book: str, sheet: str, lines: Sequence[str]) -> str:
        """The CSV LibreOffice's export writes beside a book: ``<stem>-<sheet>.csv``."""
        p = Path(book)
        return self.text(
            str(p.with_name(f"{p.with_suffix('').name}-{sheet}.csv").relative_to(self.root)),
            "\n".join(lines) + "\n",
        )

    # ------------------------------------------------------------------ documents
    def docx(self, name: str, build: Callable[[Any], None]) -> str:
        """A Word document: ``build(document)`` adds paragraphs, runs, tables, images."""
        import docx

        d = docx.Document()
        build(d)
        p = self.path(name)
        d.save(p)
        return str(p)

    def pptx(self, name: str, build: Callable[[Any], None]) -> str:
        """A presentation: ``build(presentation)`` adds slides and shapes."""
        import pptx

        prs = pptx.Presentation()
        build(prs)
        p = self.path(name)
        prs.save(p)
        return str(p)

    def odt(self, name: str, paragraphs: Sequence[str]) -> str:
        """An OpenDocument text file with one ``text:p`` per paragraph."""
        from odf.opendocument import OpenDocumentText
        from odf.text import P

        doc = OpenDocumentText()
        for t in paragraphs:
            doc.text.addElement(P(text=t))
        p = self.path(name)
        doc.save(str(p))
        return str(p)

    def pdf(self, name: str, pages: Sequence[Mapping[str, Any]]) -> str:
        """A PDF with one page per entry: ``{"lines": [...], "images": [PIL RGB images]}``.

        Text is Helvetica (a standard font every reader maps to Unicode), images are Flate
        RGB XObjects drawn side by side under the text.
        """
        import zlib

        objs: list[bytes] = []

        def add(body: bytes) -> int:
            objs.append(body)
            return len(objs)

        font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
        page_ids: list[int] = []
        # objects: the font, then per page its images, its content and itself; then Pages
        pages_id = 1 + sum(len(p.get("images", [])) + 2 for p in pages) + 1
        for page in pages:
            names = []
            for k, img in enumerate(page.get("images", [])):
                raw = zlib.compress(img.convert("RGB").tobytes())
                head = (
                    f"<< /Type /XObject /Subtype /Image /Width {img.width} /Height {img.height} "
                    f"/ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /FlateDecode "
                    f"/Length {len(raw)} >>"
                ).encode()
                names.append((f"Im{k}", add(head + b"\nstream\n" + raw + b"\nendstream"), img))
            ops = ["BT /F1 12 Tf 72 720 Td 14 TL"]
            for line in page.get("lines", []):
                text = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
                ops.append(f"({text}) Tj T*")
            ops.append("ET")
            x = 72
            for nm, _, img in names:
                ops.append(f"q {img.width} 0 0 {img.height} {x} 400 cm /{nm} Do Q")
                x += img.width + 10
            content = "\n".join(ops).encode("latin-1")
            c = add(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
            xobjs = " ".join(f"/{nm} {i} 0 R" for nm, i, _ in names)
            res = f"<< /Font << /F1 {font} 0 R >> /XObject << {xobjs} >> >>".encode()
            page_ids.append(
                add(
                    b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Resources " % pages_id
                    + res
                    + b" /Contents %d 0 R >>" % c
                )
            )
        kids = " ".join(f"{i} 0 R" for i in page_ids).encode()
        assert (
            add(b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % len(page_ids)) == pages_id
        )
        catalog = add(b"<< /Type /Catalog /Pages %d 0 R >>" % pages_id)
        out = bytearray(b"%PDF-1.4\n")
        offsets = []
        for i, body in enumerate(objs, start=1):
            offsets.append(len(out))
            out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
        xref = len(out)
        out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
        out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
        out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
            len(objs) + 1,
            catalog,
            xref,
        )
        p = self.path(name)
        p.write_bytes(bytes(out))
        return str(p)

    # ------------------------------------------------------------------ images
    def image(self, name: str, make: Callable[[], Any]) -> str:
        """An image file: ``make()`` returns a PIL image, saved in the name's format."""
        img = make()
        p = self.path(name)
        img.save(p)
        return str(p)


class AppsSource(LibrarySource):
    """Files as the real applications write them (LibreOffice, GIMP in a jailed desktop).

    Args:
      root: where the files go.
      apps: the shared ``RealApps`` desktop.
    """

    name = "apps"

    def __init__(self, root: Path, apps: Any) -> None:
        super().__init__(root)
        self.apps = apps

    def _office(self, path: str, ext: str | None = None, view: bool = False) -> str:
        p = Path(path)
        data = self.apps.office(p.read_bytes(), p.name, ext or p.suffix.lstrip("."), view=view)
        p.write_bytes(data)
        return path

    def xlsx(self, name, sheets, *, edit=None):  # type: ignore[no-untyped-def]
        import openpyxl

        path = super().xlsx(name, sheets, edit=edit)
        # Frozen panes and zoom are view settings: Calc writes them only from a view, so such
        # a book is opened with one (as in a user's Calc); the others hidden (faster).
        wb = openpyxl.load_workbook(path)
        view = any(ws.freeze_panes or ws.sheet_view.zoomScale for ws in wb.worksheets)
        return self._office(path, view=view)

    def docx(self, name, build):  # type: ignore[no-untyped-def]
        return self._office(super().docx(name, build))

    def pptx(self, name, build):  # type: ignore[no-untyped-def]
        return self._office(super().pptx(name, build))

    def odt(self, name, paragraphs):  # type: ignore[no-untyped-def]
        return self._office(super().odt(name, paragraphs))

    def pdf(self, name, pages):  # type: ignore[no-untyped-def]
        """LibreOffice's PDF export of a document with one page per entry (lines, then images)."""
        import io

        import docx
        from docx.enum.text import WD_BREAK
        from docx.shared import Pt

        d = docx.Document()
        for i, page in enumerate(pages):
            for line in page.get("lines", []):
                d.add_paragraph(line)
            for img in page.get("images", []):
                buf = io.BytesIO()
                img.convert("RGB").save(buf, "PNG")
                buf.seek(0)
                d.add_picture(buf, width=Pt(img.width), height=Pt(img.height))
            if i + 1 < len(pages):
                d.add_paragraph().add_run().add_break(WD_BREAK.PAGE)
        buf = io.BytesIO()
        d.save(buf)
        p = self.path(name)
        p.write_bytes(self.apps.office(buf.getvalue(), p.with_suffix(".docx").name, "pdf"))
        return str(p)

    def image(self, name, make):  # type: ignore[no-untyped-def]
        p = Path(super().image(name, make))
        p.write_bytes(self.apps.gimp(p.read_bytes(), p.name))
        return str(p)


SOURCES: dict[str, Callable[..., Any]] = {"library": LibrarySource, "apps": AppsSource}
#: Sources that need the real applications (``RealApps``).
APP_SOURCES = {"apps"}


def source_names() -> list[str]:
    """The sources the tests run with: ``$OSWORLD_JAX_FIXTURE_SOURCE`` alone, or all."""
    name = os.environ.get("OSWORLD_JAX_FIXTURE_SOURCE")
    if name is None:
        return list(SOURCES)
    if name not in SOURCES:
        raise KeyError(f"OSWORLD_JAX_FIXTURE_SOURCE={name!r}: known sources {sorted(SOURCES)}")
    return [name]


def make_source(root: Path, name: str = "library", apps: Any = None) -> Any:
    """The fixture source ``name`` writing under ``root`` (``apps``: the shared ``RealApps``)."""
    return SOURCES[name](root, apps) if name in APP_SOURCES else SOURCES[name](root)

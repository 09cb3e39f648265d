"""Where the metric tests' input files come from: a swappable fixture source.

A test describes a document (sheets and cells, paragraphs and runs, slides and shapes) and asks
the active source to write it. ``LibrarySource`` writes it with the Python libraries of each
format (openpyxl, python-docx, python-pptx, odfpy, Pillow) — the same file formats LibreOffice,
GIMP and the other apps write. A source that makes the file with the real application in the jail
(e.g. build with the library, then open and re-save it through ``soffice --convert-to`` inside a
local sandbox) only needs the same methods; register it in ``SOURCES`` and select it with
``OSWORLD_JAX_FIXTURE_SOURCE=<name>``.

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

    # ------------------------------------------------------------------ images
    def image(self, name: str, make: Callable[[], Any]) -> str:
        """An image file: ``make()`` returns a PIL image, saved in the name's format."""
        img = make()
        p = self.path(name)
        img.save(p)
        return str(p)


SOURCES: dict[str, Callable[[Path], Any]] = {"library": LibrarySource}


def make_source(root: Path) -> Any:
    """The source named by ``$OSWORLD_JAX_FIXTURE_SOURCE`` (default ``library``)."""
    name = os.environ.get("OSWORLD_JAX_FIXTURE_SOURCE", "library")
    if name not in SOURCES:
        raise KeyError(f"OSWORLD_JAX_FIXTURE_SOURCE={name!r}: known sources {sorted(SOURCES)}")
    return SOURCES[name](root)

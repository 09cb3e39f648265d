"""Spreadsheet comparison (``compare_table``) for the files local apps write: CSV and XLSX.

Follows upstream ``desktop_env/evaluators/metrics/table.py`` for the rule types implemented here:

- ``sheet_name``: the result's sheet names equal the expected file's;
- ``sheet_data``: two sheets hold the same values (floats rounded to ``precision`` decimals,
  default 4; ``ignore_case`` folds strings); ``sheet_idx0``/``sheet_idx1`` pick sheets as
  ``0`` (= ``"RI0"``, result by index), ``"RNSheet1"`` (result by name), ``"EI0"``, ``"ENSheet1"``;
- ``check_cell``: ``props`` rules ``{value: {method, ref}}`` on one cell (``sheet_idx``,
  ``coordinate`` like ``"B3"``).

Other rule types (charts, pivots, styles, filters, ...) are reported by ``unsupported_options``
so ``capabilities`` marks such tasks not runnable instead of mis-scoring them. Without ``rules``
every sheet is compared by name and data. CSV files are one sheet named after the file stem; a
numeric-looking CSV cell is read as a number so CSV and XLSX compare alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env.evaluators.metrics import match_value_to_rule
from osworld_jax.env.evaluators.registry import METRICS

Sheet = list[list[Any]]
_SUPPORTED_RULES = {"sheet_name", "sheet_data", "check_cell"}


def _cell(text: str) -> Any:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _trim(rows: Sheet) -> Sheet:
    rows = [list(r) for r in rows]
    for r in rows:
        while r and r[-1] in (None, ""):
            r.pop()
    while rows and not rows[-1]:
        rows.pop()
    return rows


def load_book(path: str | Path) -> dict[str, Sheet]:
    """The workbook as ``{sheet name: rows of cell values}`` (ordered as in the file)."""
    p = Path(path)
    if p.suffix.lower() in (".csv", ".tsv"):
        import csv

        delim = "\t" if p.suffix.lower() == ".tsv" else ","
        with p.open(newline="", encoding="utf-8-sig") as f:
            rows = [[_cell(c) for c in row] for row in csv.reader(f, delimiter=delim)]
        return {p.stem: _trim(rows)}
    import openpyxl

    wb = openpyxl.load_workbook(p, data_only=True, read_only=True)
    try:
        return {ws.title: _trim([list(r) for r in ws.iter_rows(values_only=True)]) for ws in wb}
    finally:
        wb.close()


def _pick(idx: Any, result: dict[str, Sheet], expected: dict[str, Sheet] | None) -> Sheet | None:
    if isinstance(idx, int):
        idx = f"RI{idx}"
    book = result if idx[0] == "R" else expected
    if book is None:
        raise ValueError(f"compare_table: sheet {idx!r} refers to a missing expected file")
    names = list(book)
    if idx[1] == "I":
        i = int(idx[2:])
        return book[names[i]] if 0 <= i < len(names) else None
    return book.get(idx[2:])


def _norm(v: Any, precision: int, ignore_case: bool) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, float):
        v = round(v, precision)
        return int(v) if v.is_integer() else v
    if isinstance(v, str) and ignore_case:
        return v.lower()
    return v


def _same(a: Sheet, b: Sheet, precision: int, ignore_case: bool) -> bool:
    def norm(s: Sheet) -> Sheet:
        return [[_norm(v, precision, ignore_case) for v in row] for row in s]

    return norm(a) == norm(b)


def _coordinate(coord: str) -> tuple[int, int]:
    col = 0
    i = 0
    while i < len(coord) and coord[i].isalpha():
        col = col * 26 + (ord(coord[i].upper()) - ord("A") + 1)
        i += 1
    return int(coord[i:]) - 1, col - 1


@METRICS.register("compare_table")
def compare_table(result: str | None, expected: str | None = None, **options: Any) -> float:
    """1 iff every rule of ``options["rules"]`` holds (see the module docstring)."""
    if result is None or not Path(result).is_file():
        return 0.0
    try:
        rbook = load_book(result)
    except Exception:  # noqa: BLE001 - an unreadable result file scores 0, as upstream
        return 0.0
    ebook = load_book(expected) if expected is not None else None
    rules = options.get("rules")
    if rules is None:
        if ebook is None:
            raise ValueError("compare_table without rules needs an expected file")
        rules = [{"type": "sheet_name"}] + [
            {"type": "sheet_data", "sheet_idx0": f"RI{i}", "sheet_idx1": f"EI{i}"}
            for i in range(len(ebook))
        ]
    r: Any
    for r in rules:
        kind = r["type"]
        if kind == "sheet_name":
            ok = ebook is not None and list(rbook) == list(ebook)
        elif kind == "sheet_data":
            s0 = _pick(r["sheet_idx0"], rbook, ebook)
            s1 = _pick(r["sheet_idx1"], rbook, ebook)
            ok = (
                s0 is not None
                and s1 is not None
                and _same(s0, s1, int(r.get("precision", 4)), bool(r.get("ignore_case", False)))
            )
        elif kind == "check_cell":
            sheet = _pick(r["sheet_idx"], rbook, ebook)
            row, col = _coordinate(r["coordinate"])
            value = None
            if sheet is not None and row < len(sheet) and col < len(sheet[row]):
                value = sheet[row][col]
            ok = sheet is not None and all(
                prop == "value" and match_value_to_rule(value, rule)
                for prop, rule in r["props"].items()
            )
        else:
            raise ValueError(f"compare_table: rule type {kind!r} is not supported")
        if not ok:
            return 0.0
    return 1.0


def _unsupported(options: Mapping[str, Any]) -> list[str]:
    out = []
    for r in options.get("rules") or []:
        kind = r.get("type")
        if kind not in _SUPPORTED_RULES:
            out.append(f"compare_table rule {kind}")
        elif kind == "check_cell" and set(r.get("props", {})) - {"value"}:
            out.append("compare_table check_cell props " + ",".join(sorted(r["props"])))
    return out


compare_table.unsupported_options = _unsupported  # type: ignore[attr-defined]

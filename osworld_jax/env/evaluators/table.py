"""Spreadsheet metrics: ``compare_table``, ``compare_csv``, ``compare_conference_city_in_order``.

``compare_table(result, expected, rules=[...])`` follows upstream ``metrics/table.py``: both
workbooks are opened with openpyxl (formulas as written) and pandas (cached values); each rule is
checked in order and the first failing one scores 0. Sheets are named by ``sheet_idx``: an int
``i`` or ``"RI<i>"`` (the result's i-th sheet), ``"RN<name>"``, ``"EI<i>"``, ``"EN<name>"`` (the
expected book's). Rule types:

- ``sheet_name``: equal sheet-name lists; ``sheet_data``: ``pandas.read_excel`` frames equal
  after rounding to ``precision`` (default 4) decimals (dtypes included, as ``DataFrame.equals``);
- ``sheet_print``: the CSV LibreOffice printed next to each book (``<book stem>-<sheet>.csv``)
  has the same lines (``ignore_case``);
- ``sheet_fuzzy``: per cell range, ``exact_match`` / ``includes`` / ``included_by`` /
  ``fuzzy_match`` (rapidfuzz ratio >= ``threshold``) after ``normalization`` replacements,
  ``trim_leadings``/``trim_trailings``, ``ignore_chars`` and ``ignore_case``;
- ``check_cell``: ``props`` rules on one cell's ``value`` and styles (see ``sheets``);
- ``chart``, ``pivot_table``, ``style`` (with conditional formats), ``freeze``, ``zoom``,
  ``data_validation``, ``row_props``, ``col_props``, ``filter``, ``sparkline``: equal properties
  as read by
  ``osworld_jax.env.evaluators.sheets``.

Deliberate differences (``docs/EVALUATORS.md`` lists the affected tasks): ``sheet_data`` honours
``ignore_case`` (upstream ignores it there; only ``sheet_print`` folds case), and its integer
columns compare as floats (upstream's ``DataFrame.equals`` fails on an int64 column against a
float64 one holding the same numbers, e.g. 90 against 90.0).
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env.evaluators import sheets
from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import match_value_to_rule, read_lines_any_encoding

_SUPPORTED_RULES = {
    "sheet_name", "sheet_data", "sheet_print", "sheet_fuzzy", "check_cell", "chart",
    "pivot_table", "style", "freeze", "zoom", "data_validation", "row_props", "col_props",
    "filter", "sparkline",
}  # fmt: skip


_CSV_SEPARATORS = {".csv": ",", ".tsv": "\t"}


class _Book:
    """One workbook opened the ways the rules read it (openpyxl, pandas, raw XML by path).

    A ``.csv`` / ``.tsv`` file (an extension for the bundled offline tasks; upstream cannot open
    one and scores 0) is a book of one sheet named after the file's stem: ``sheet_name``,
    ``sheet_data`` (``pandas.read_csv``) and ``check_cell`` values work on it, other rules see
    no sheet.
    """

    def __init__(self, path: str) -> None:
        import openpyxl
        import pandas as pd

        self.path = path
        self.sep = _CSV_SEPARATORS.get(Path(path).suffix.lower())
        self.xl: Any = None
        self.pd: Any = None
        if self.sep is not None:
            self.csv = pd.read_csv(path, sep=self.sep)
            self.names: list[str] = [Path(path).stem]
            return
        self.xl = openpyxl.load_workbook(filename=path)
        self.pd = pd.ExcelFile(path)
        self.names = list(self.pd.sheet_names)

    def cell_value(self, sheet: str, coordinate: str) -> Any:
        """A cell's stored value (see ``sheets.read_cell_value``; CSV numbers read as float)."""
        if self.sep is None:
            return sheets.read_cell_value(self.path, sheet, coordinate)
        if sheet != self.names[0]:
            return None
        import csv

        from openpyxl.utils.cell import column_index_from_string, coordinate_from_string

        col, row = coordinate_from_string(coordinate)
        with open(self.path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f, delimiter=self.sep))
        i, j = row - 1, column_index_from_string(col) - 1
        text = rows[i][j] if i < len(rows) and j < len(rows[i]) else ""
        if text == "":
            return None
        try:
            return float(text)
        except ValueError:
            return text


def _parse_idx(idx: Any, result: _Book, expected: _Book | None) -> tuple[_Book | None, str]:
    """``(book, sheet name)`` for a ``sheet_idx``; an out-of-range index gives the name ""."""

    def nth(book: _Book | None, i: str | int) -> str:
        try:
            return book.names[int(i)] if book is not None else ""
        except (IndexError, ValueError):
            return ""

    if isinstance(idx, int):
        return result, nth(result, idx)
    head, tail = str(idx)[:2], str(idx)[2:]
    if head == "RI":
        return result, nth(result, tail)
    if head == "RN":
        return result, tail
    if head == "EI":
        return expected, nth(expected, tail)
    if head == "EN":
        return expected, tail
    raise ValueError(f"compare_table: unrecognized sheet index {idx!r}")


def _need(book: _Book | None, idx: Any) -> _Book:
    if book is None:
        raise ValueError(f"compare_table: sheet {idx!r} refers to a missing expected file")
    return book


def _frame(book: _Book, name: str) -> Any:
    import pandas as pd

    if book.sep is not None:
        return book.csv if name == book.names[0] else None
    try:
        return pd.read_excel(book.pd, name)
    except Exception:  # noqa: BLE001 - a missing sheet reads as none, as upstream
        return None


def _worksheet(book: _Book, name: str) -> Any:
    if book.xl is None:
        return None
    try:
        return book.xl[name]
    except KeyError:
        return None


def _fuzzy_cells(rule: Mapping[str, Any], a: tuple[str, str], b: tuple[str, str]) -> bool:
    from openpyxl.utils import get_column_letter
    from openpyxl.worksheet.cell_range import MultiCellRange
    from rapidfuzz import fuzz

    ok = True
    for rng in MultiCellRange(rule["range"]):
        for row, col in rng.cells:
            coord = f"{get_column_letter(col)}{row}"
            v1 = str(sheets.read_cell_value(*a, coord))
            v2 = str(sheets.read_cell_value(*b, coord))
            for old, new in rule.get("normalization", []):
                v1, v2 = v1.replace(old, new), v2.replace(old, new)
            if "trim_leadings" in rule:
                v1, v2 = v1.lstrip(rule["trim_leadings"]), v2.lstrip(rule["trim_leadings"])
            if "trim_trailings" in rule:
                v1, v2 = v1.rstrip(rule["trim_trailings"]), v2.rstrip(rule["trim_trailings"])
            if "ignore_chars" in rule:
                drop = set(rule["ignore_chars"])
                v1 = "".join(ch for ch in v1 if ch not in drop)
                v2 = "".join(ch for ch in v2 if ch not in drop)
            if rule.get("ignore_case", False):
                v1, v2 = v1.lower(), v2.lower()
            kind = rule["type"]
            if kind == "includes":
                ok = ok and v2 in v1
            elif kind == "included_by":
                ok = ok and v1 in v2
            elif kind == "fuzzy_match":
                ok = ok and fuzz.ratio(v1, v2) >= rule.get("threshold", 85.0)
            elif kind == "exact_match":
                ok = ok and v1 == v2
            else:
                raise ValueError(f"compare_table: sheet_fuzzy type {kind!r} is not supported")
    return ok


def _check_cell(r: Mapping[str, Any], rb: _Book, eb: _Book | None) -> bool:
    try:
        book, name = _parse_idx(r["sheet_idx"], rb, eb)
        book = _need(book, r["sheet_idx"])
        ws = _worksheet(book, name)
        if ws is None and not (book.sep is not None and name == book.names[0]):
            return False
        cell = ws[r["coordinate"]] if ws is not None else None
        ok = True
        for prop, rule in r["props"].items():
            if prop == "value":
                value = book.cell_value(name, r["coordinate"])
            else:
                try:
                    value = sheets.read_cell_style(prop, cell)
                except Exception:  # noqa: BLE001 - upstream reads an unreadable style as None
                    value = None
            ok = ok and match_value_to_rule(value, rule)
        return bool(ok)
    except Exception:  # noqa: BLE001 - upstream scores an error while checking a cell as 0
        return False


def _pair(r: Mapping[str, Any], rb: _Book, eb: _Book | None) -> tuple[tuple[_Book, str], ...]:
    out = []
    for key in ("sheet_idx0", "sheet_idx1"):
        book, name = _parse_idx(r[key], rb, eb)
        out.append((_need(book, r[key]), name))
    return tuple(out)


def _rule(r: Mapping[str, Any], rb: _Book, eb: _Book | None) -> bool:  # noqa: C901
    """Whether one ``compare_table`` rule holds."""
    kind = r["type"]
    if kind == "sheet_name":
        return eb is not None and rb.names == eb.names
    if kind == "check_cell":
        return _check_cell(r, rb, eb)
    if kind in ("zoom", "data_validation"):
        book, name = _parse_idx(r["sheet_idx"], rb, eb)
        ws = _worksheet(_need(book, r["sheet_idx"]), name)
        if ws is None:
            return False
        if kind == "zoom":
            return match_value_to_rule(ws.sheet_view.zoomScale or 100.0, r)
        dvs, wanted = sheets.data_validations(ws), r["dv_props"]
        ok = len(dvs) >= len(wanted)
        for dv in dvs:
            ok = ok and any(
                all(match_value_to_rule(getattr(dv, a), m) for a, m in p.items()) for p in wanted
            )
            if not ok:
                break
        return ok
    (b0, n0), (b1, n1) = _pair(r, rb, eb)
    if kind == "sheet_data":
        f0 = _frame(b0, n0)
        f1 = _frame(b1, n1) if f0 is not None else None
        if f0 is None or f1 is None:
            return False
        precision = r.get("precision", 4)
        if r.get("ignore_case", False):
            f0, f1 = _lower_strings(f0), _lower_strings(f1)
        f0, f1 = _ints_as_floats(f0.round(precision)), _ints_as_floats(f1.round(precision))
        return bool(f0.equals(f1))
    if kind == "sheet_print":
        s0 = sheets.sheet_csv_lines(b0.path, n0)
        s1 = sheets.sheet_csv_lines(b1.path, n1) if s0 is not None else None
        if s0 is None or s1 is None:
            return False
        if r.get("ignore_case", False):
            s0, s1 = [x.lower() for x in s0], [x.lower() for x in s1]
        return s0 == s1
    if kind == "sheet_fuzzy":
        return all(_fuzzy_cells(fr, (b0.path, n0), (b1.path, n1)) for fr in r["rules"])
    if kind == "freeze":
        w0 = _worksheet(b0, n0)
        w1 = _worksheet(b1, n1) if w0 is not None else None
        if w0 is None or w1 is None:
            return False
        return sheets.freeze_key(w0) == sheets.freeze_key(w1)
    loaders = {
        "chart": lambda b, n: sheets.load_charts(b.xl, n, **r),
        "pivot_table": lambda b, n: sheets.load_pivot_tables(b.xl, n, **r),
        "style": lambda b, n: sheets.load_xlsx_styles(b.xl, n, b.path, **r),
        "row_props": lambda b, n: sheets.load_rows_or_cols(b.xl, n, **{**r, "obj": "row"}),
        "col_props": lambda b, n: sheets.load_rows_or_cols(b.xl, n, **{**r, "obj": "column"}),
        "filter": lambda b, n: sheets.load_filters(b.xl, n, **r),
        "sparkline": lambda b, n: sheets.load_sparklines(b.path, n),
    }
    if kind in loaders:
        return bool(loaders[kind](b0, n0) == loaders[kind](b1, n1))
    raise ValueError(f"compare_table: rule type {kind!r} is not supported")


def _ints_as_floats(frame: Any) -> Any:
    """Integer columns as float64, so 90 and 90.0 compare equal (upstream: dtypes must match)."""
    import pandas as pd

    ints = [c for c in frame.columns if pd.api.types.is_integer_dtype(frame[c].dtype)]
    return frame.astype(dict.fromkeys(ints, "float64")) if ints else frame


def _lower_strings(frame: Any) -> Any:
    frame = frame.map(lambda v: v.lower() if isinstance(v, str) else v)
    frame.columns = [c.lower() if isinstance(c, str) else c for c in frame.columns]
    return frame


@METRICS.register("compare_table")
def compare_table(result: str | None, expected: str | None = None, **options: Any) -> float:
    """1 iff every rule of ``options["rules"]`` holds (see the module docstring).

    A missing or unreadable result workbook scores 0; an unreadable expected one raises.
    """
    if result is None or not Path(result).is_file():
        return 0.0
    try:
        rb = _Book(result)
    except Exception:  # noqa: BLE001 - an unreadable result file scores 0, as upstream
        return 0.0
    eb = _Book(expected) if expected is not None else None
    if "rules" not in options:
        raise ValueError("compare_table: options need 'rules'")
    for r in options["rules"]:
        if not _rule(r, rb, eb):
            return 0.0
    return 1.0


def _unsupported(options: Mapping[str, Any]) -> list[str]:
    # compare_table reads every book through pandas and openpyxl: without them it could only
    # score 0 (an unreadable result), so a task needing it is not runnable here.
    out = [
        f"compare_table needs {m} (not installed)"
        for m in ("pandas", "openpyxl")
        if importlib.util.find_spec(m) is None
    ]
    for r in options.get("rules") or []:
        kind = r.get("type")
        if kind not in _SUPPORTED_RULES:
            out.append(f"compare_table rule {kind}")
    return out


compare_table.unsupported_options = _unsupported  # type: ignore[attr-defined]


@METRICS.register("compare_csv")
def compare_csv(result: str | None, expected: str | list[str], **options: Any) -> float:
    """1 iff the result CSV has the same lines as the expected one (or as any of a list).

    Files decode as UTF-8 (a BOM kept: it makes the first line differ from one without, as
    upstream), else Latin-1; ``strict=False`` strips each line,
    ``ignore_case`` folds case. An expected file that cannot be read is skipped.
    """
    if result is None:
        return 0.0
    try:
        got = read_lines_any_encoding(result)
    except OSError:
        return 0.0
    golds = [expected] if isinstance(expected, str) else list(expected or [])

    def norm(lines: list[str]) -> list[str]:
        if not options.get("strict", True):
            lines = [x.strip() for x in lines]
        if options.get("ignore_case", False):
            lines = [x.lower() for x in lines]
        return lines

    for gold in golds:
        try:
            want = read_lines_any_encoding(gold)
        except (OSError, TypeError):
            continue
        if norm(got) == norm(want):
            return 1.0
    return 0.0


def _city_key(value: Any) -> str:
    if value is None:
        return ""
    text = unicodedata.normalize("NFKD", str(value))
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


@METRICS.register("compare_conference_city_in_order")
def compare_conference_city_in_order(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff each of cells C2:C22 of the active sheet contains its expected city, in order.

    Each expected entry is a city or a list of accepted spellings; cells and cities compare
    after folding case, accents and punctuation (a city must be a substring of its cell).
    """
    if result is None:
        return 0.0
    import openpyxl

    try:
        ws = openpyxl.load_workbook(result).active
    except Exception:  # noqa: BLE001 - an unreadable workbook is not the answer
        return 0.0
    want = rules["expected"]
    cells = [c.value for row in ws["C2:C22"] for c in row]
    try:
        for i, got in enumerate(cells):
            entry = want[i]
            options = [entry] if isinstance(entry, str) else list(entry)
            key = _city_key(got)
            if not any(_city_key(o) and _city_key(o) in key for o in options):
                return 0.0
    except (IndexError, TypeError):
        return 0.0
    return 1.0

"""Readers of XLSX workbooks for ``compare_table`` (no jax).

The properties each reader returns follow upstream ``metrics/utils.py`` (``read_cell_value``,
``_read_cell_style``, ``load_charts``, ``load_pivot_tables``, ``load_filters``,
``load_rows_or_cols``, ``load_xlsx_styles``) so that two workbooks compare equal here exactly when
they do upstream: the same openpyxl attributes, the same quirks (a chart's anchor lists
``to.row`` twice; a cell's value is read from the raw sheet XML, where a boolean reads as None).
"""

from __future__ import annotations

import itertools
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lxml import etree

from osworld_jax.env.evaluators.rules import parse_xml, read_lines_any_encoding

_MAIN = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
_NS = {"oo": _MAIN}


def _sheet_ids(z: zipfile.ZipFile) -> dict[str, str]:
    root = parse_xml(z.read("xl/workbook.xml"))
    return {s.get("name"): s.get("sheetId") for s in root.iterfind("oo:sheets/oo:sheet", _NS)}


def _shared_strings(z: zipfile.ZipFile) -> list[str]:
    try:
        root = parse_xml(z.read("xl/sharedStrings.xml"))
        return [
            "".join(t.text for t in si.iter(f"{{{_MAIN}}}t")) for si in root.iterfind("oo:si", _NS)
        ]
    except Exception:  # noqa: BLE001 - upstream: unreadable shared strings mean none
        return []


def _as_xmltodict(elem: Any) -> Any:
    """An element's value the way upstream's ``xmltodict.parse`` hands it over.

    The text is stripped; an element with attributes (``<t xml:space="preserve">``, which
    writers add to text with leading or trailing blanks) becomes ``{"@<ns>:<name>": value, ...,
    "#text": text}``, so upstream compares its ``str()`` and we do too.
    """
    if elem is None:
        return None
    text = (elem.text or "").strip() or None
    if not elem.attrib:
        return text
    out: dict[str, Any] = {}
    for key, value in elem.attrib.items():
        qname = etree.QName(key)
        out["@" + (f"{qname.namespace}:{qname.localname}" if qname.namespace else key)] = value
    if text is not None:
        out["#text"] = text
    return out


def read_cell_value(xlsx: str | Path, sheet_name: str, coordinate: str) -> Any:
    """The value of one cell as stored in the sheet's XML (formulas give their cached value).

    Numbers (no type or ``t="n"``) come back as float, shared / formula / inline strings as str
    (formula and inline strings stripped, as upstream's XML parsing leaves them), errors as their
    text (``#DIV/0!``); booleans, dates and empty cells as None. The sheet is
    ``xl/worksheets/sheet<sheetId>.xml``, as upstream looks it up. None when the file, sheet or
    cell is missing.
    """
    try:
        with zipfile.ZipFile(xlsx) as z:
            shared = _shared_strings(z)
            sheet_id = _sheet_ids(z)[sheet_name]
            root = parse_xml(z.read(f"xl/worksheets/sheet{sheet_id}.xml"))
    except Exception:  # noqa: BLE001 - missing file/sheet, bad zip: upstream returns None
        return None
    cells = root.xpath("oo:sheetData/oo:row/oo:c[@r=$r]", namespaces=_NS, r=coordinate)
    if not cells:
        return None
    c = cells[0]
    kind = c.get("t")
    v = c.find("oo:v", _NS)
    try:
        if kind is None or kind == "n":
            return float(v.text)  # type: ignore[union-attr,arg-type]
        if kind == "s":
            return shared[int(v.text)]  # type: ignore[union-attr,arg-type]
        if kind in ("str", "e"):
            return _as_xmltodict(v)
        if kind == "inlineStr":
            return _as_xmltodict(c.find("oo:is/oo:t", _NS))
    except (AttributeError, ValueError, TypeError):
        return None
    return None


_X14 = "http://schemas.microsoft.com/office/spreadsheetml/2009/9/main"
_XM = "http://schemas.microsoft.com/office/excel/2006/main"


def load_sparklines(xlsx: str | Path, sheet_name: str) -> dict[str, str]:
    """``{target cells: source range}`` of the sheet's sparklines (``{"F3": "Sheet1!C3:E3"}``).

    Raises:
      KeyError: the sheet does not exist (upstream raises too).
    """
    try:
        with zipfile.ZipFile(xlsx) as z:
            sheet_id = _sheet_ids(z)[sheet_name]
            root = parse_xml(z.read(f"xl/worksheets/sheet{sheet_id}.xml"))
    except zipfile.BadZipFile:
        return {}
    out = {}
    for sp in root.iter(f"{{{_X14}}}sparkline"):
        out[sp.findtext(f"{{{_XM}}}sqref")] = sp.findtext(f"{{{_XM}}}f")
    return out


def read_cell_style(name: str, cell: Any, diff_style: Any = None) -> Any:
    """One style property of an openpyxl cell (or of a conditional format's ``diff_style``).

    ``number_format`` (numeric cells only), ``font_name``, ``font_family``, ``font_color``
    (aRGB), ``font_bold``, ``font_italic``, ``font_underline``, ``font_size`` (None for empty
    cells), ``fill_type``, ``bgcolor`` / ``fgcolor`` (the fill's foreground colour; a
    conditional format's background colour), ``hyperlink``, ``merge`` (the cell is covered by a
    merged range and is not its first cell).

    Raises:
      NotImplementedError: an unknown property.
    """
    src = diff_style or cell
    empty = cell.value is None
    if name == "number_format":
        if empty or cell.data_type != "n":
            return None
        return cell.number_format if diff_style is None else diff_style.numFmt.formatCode
    fonts = {
        "font_name": "name",
        "font_family": "family",
        "font_bold": "bold",
        "font_italic": "italic",
        "font_underline": "underline",
        "font_size": "size",
    }
    if name in fonts:
        return None if empty else getattr(src.font, fonts[name])
    if name == "font_color":
        return None if empty else src.font.color.rgb
    if name == "fill_type":
        try:
            return src.fill.tagname
        except AttributeError:
            return None
    if name in ("bgcolor", "fgcolor"):
        try:
            return diff_style.fill.bgColor.rgb if diff_style is not None else cell.fill.fgColor.rgb
        except AttributeError:
            return None
    if name == "hyperlink":
        return None if empty else (cell.hyperlink or "")
    if name == "merge":
        from openpyxl.cell.cell import MergedCell

        return isinstance(cell, MergedCell)
    raise NotImplementedError(f"compare_table: unsupported cell style {name!r}")


def _rich_title(title: Any) -> Any:
    try:
        return title.tx.rich.p[0].r[0].t
    except (AttributeError, IndexError, TypeError):
        return None


def _ref(data: Any) -> str:
    for kind in ("numRef", "strRef"):
        ref = getattr(data, kind, None)
        if ref is not None and getattr(ref, "f", None) is not None:
            return str(ref.f)
    return ""


def load_charts(book: Any, sheet: str, **options: Any) -> dict[str, Any]:
    """``{series refs: {prop: value}}`` of the sheet's charts for ``options["chart_props"]``.

    A chart is keyed by its series as ``"<values ref>,<categories ref>"`` joined by ``;``.
    Properties: ``title``, ``legend`` (position), ``anchor``, ``width``, ``height``, ``type``
    (the chart's XML tag, e.g. ``barChart``), ``direction`` (``bar``/``col``), ``xtitle``,
    ``ytitle``, ``ztitle``.
    """
    try:
        ws = book[sheet]
    except KeyError:
        return {}
    props = set(options.get("chart_props", []))
    out: dict[str, Any] = {}
    for ch in ws._charts:
        key = ";".join(f"{_ref(s.val)},{_ref(s.cat)}" for s in ch.series)
        info: dict[str, Any] = {}
        if "title" in props:
            info["title"] = _rich_title(ch.title)
        if "legend" in props:
            info["legend"] = ch.legend.position if ch.legend is not None else None
        if "anchor" in props:
            a = ch.anchor
            info["anchor"] = [a.editAs, a._from.col, a.to.row, a.to.col, a.to.row]
        if "width" in props:
            info["width"] = ch.width
        if "height" in props:
            info["height"] = ch.height
        if "type" in props:
            info["type"] = ch.tagname
        if "direction" in props:
            info["direction"] = ch.barDir
        for axis in ("x", "y", "z"):
            if f"{axis}title" in props:
                ax = getattr(ch, f"{axis}_axis", None)
                info[f"{axis}title"] = _rich_title(getattr(ax, "title", None))
        out[key] = info
    return out


def _trim_empty(rows: list[list[Any]]) -> tuple[list[list[Any]], int, int]:
    lead = list(itertools.dropwhile(lambda r: not r, rows))
    left = len(rows) - len(lead)
    kept = list(itertools.dropwhile(lambda r: not r, reversed(lead)))[::-1]
    return kept, left, len(lead) - len(kept)


def load_pivot_tables(book: Any, sheet: str, **options: Any) -> dict[str, Any]:
    """``{source: {prop: value}}`` of the sheet's pivot tables for ``options["pivot_props"]``.

    The source is ``"<type>;(row, col):(row, col);<sheet>"`` of the cache's worksheet range,
    narrowed to the fields that have items. Properties: ``name``, ``show_total``,
    ``show_empty_row``, ``show_empty_col``, ``show_headers``, ``location``, ``filter`` /
    ``selection`` (item selections per field, as sets unless ``ordered``; ``filter`` adds the
    page fields), ``col_fields``, ``row_fields``, ``data_fields`` (``"index;name;subtotal;
    show as"``, the name only with ``data_fields_name``).
    """
    from openpyxl.utils import coordinate_to_tuple

    try:
        ws = book[sheet]
    except KeyError:
        return {}
    props = set(options.get("pivot_props", []))
    out: dict[str, Any] = {}
    for pvt in ws._pivots:
        raw = [[(i.h, i.x) for i in f.items if i.x is not None] for f in pvt.pivotFields]
        selection, left, right = _trim_empty(raw)
        src = pvt.cache.cacheSource
        a, b = src.worksheetSource.ref.split(":")
        r1, c1 = coordinate_to_tuple(a)
        r2, c2 = coordinate_to_tuple(b)
        key = f"{src.type};{(r1, c1 + left)}:{(r2, c2 - right)};{src.worksheetSource.sheet}"
        info: dict[str, Any] = {}
        for prop, attr in (
            ("name", "name"),
            ("show_total", "visualTotals"),
            ("show_empty_row", "showEmptyRow"),
            ("show_empty_col", "showEmptyCol"),
            ("show_headers", "showHeaders"),
            ("location", "location"),
        ):
            if prop in props:
                info[prop] = getattr(pvt, attr)
        if "filter" in props or "selection" in props:
            info["selection"] = selection if "ordered" in props else [set(r) for r in selection]
        if "filter" in props:
            info["filter_fields"] = {f.fld for f in pvt.pageFields}
        if "col_fields" in props:
            info["col_fields"] = [f.x - left for f in pvt.colFields]
        if "row_fields" in props:
            info["row_fields"] = [f.x - left for f in pvt.rowFields]
        if "data_fields" in props:
            named = "data_fields_name" in props
            info["data_fields"] = [
                f"{f.fld - left:d};{f.name if named else ''};{f.subtotal};{f.showDataAs}"
                for f in pvt.dataFields
            ]
        out[key] = info
    return out


def load_rows_or_cols(book: Any, sheet: str, *, obj: str, **options: Any) -> dict[Any, Any]:
    """``{row number | column letter: {prop: value}}`` of the dimensions openpyxl read
    (``obj`` is ``"row"`` or ``"column"``; props such as ``hidden``, ``height``, ``width``).
    """  # noqa: D205
    try:
        ws = book[sheet]
    except KeyError:
        return {}
    props = set(options.get("props", []))
    dims = getattr(ws, f"{obj}_dimensions")
    return {k: {p: getattr(d, p) for p in props} for k, d in dims.items()}


def load_filters(book: Any, sheet: str, **options: Any) -> dict[str, Any]:
    """The sheet's auto-filter: range, filter columns (sorted by column) and sort state."""
    try:
        ws = book[sheet]
    except KeyError:
        return {}
    flt = ws.auto_filter
    columns = []
    for fc in flt.filterColumn:
        col: dict[str, Any] = {
            "col_id": fc.colId,
            "hidden_button": fc.hiddenButton,
            "show_button": fc.showButton,
        }
        if fc.filters is not None:
            col["filters_blank"] = fc.filters.blank
            col["filters"] = set(fc.filters.filter)
        if fc.customFilters is not None:
            col["custom_filters_op"] = fc.customFilters._and
            col["custom_filters"] = {(c.operator, c.val) for c in fc.customFilters.customFilter}
        columns.append(col)
    out: dict[str, Any] = {
        "ref": flt.ref,
        "filter_column": sorted(columns, key=lambda d: d["col_id"]),
    }
    ss = flt.sortState
    if ss is not None:
        out["sort_state"] = {
            "sort": ss.columnSort,
            "case": ss.caseSensitive,
            "method": ss.sortMethod,
            "ref": ss.ref,
            "condition": [
                {
                    "descending": c.descending,
                    "key": c.sortBy,
                    "ref": c.ref,
                    "custom_list": c.customList,
                    "dxf_id": c.dxfId,
                    "icon": c.iconSet,
                    "iconid": c.iconId,
                }
                for c in ss.sortCondition
            ],
        }
    return out


def freeze_key(ws: Any) -> tuple[Any, ...]:
    """What identifies a sheet's frozen panes: the frozen column/row counts (not the scroll)."""
    pane = ws.sheet_view.pane
    if pane is None:
        return ("none",)
    state = (pane.state or "").lower()
    xs = int(pane.xSplit) if pane.xSplit is not None else 0
    ys = int(pane.ySplit) if pane.ySplit is not None else 0
    if state in ("frozen", "frozensplit"):
        return ("frozen", xs, ys)
    return ("other", xs, ys, pane.topLeftCell)


def _cf_operator(op: str, value: Any, ref: list[Any]) -> bool:
    """A ``cellIs`` conditional format's test (upstream ``_process_xlsx_cf_operator``)."""
    try:
        tests: dict[str, Callable[[], bool]] = {
            "lessThanOrEqual": lambda: value <= ref[0],
            "lessThan": lambda: value < ref[0],
            "equal": lambda: value == ref[0],
            "greaterThanOrEqual": lambda: value >= ref[0],
            "notEqual": lambda: value != ref[0],
            "greaterThan": lambda: value > ref[0],
            "between": lambda: min(ref) <= value <= max(ref),
            "notBetween": lambda: value < min(ref) or value > max(ref),
        }
        return bool(tests[op]())
    except (TypeError, IndexError, KeyError):
        return False


_ABSOLUTE_RANGE = re.compile(r"\$([A-Z]{1,3})\$(\d+)(?::\$([A-Z]{1,3})\$(\d+))?")
_TEXT_RULES = {
    "expression", "containsText", "notContainsText", "endsWith", "beginsWith",
    "containsErrors", "notContainsErrors",
}  # fmt: skip


def _cf_condition(rule: Any, xlsx: str, sheet: str) -> Callable[[Any], bool] | None:
    """The test of one conditional-format rule, or None when it cannot be evaluated."""
    import formulas
    from openpyxl.utils import get_column_letter
    from openpyxl.worksheet.cell_range import CellRange

    compiled, args_per = [], []
    for fml in rule.formula:
        try:
            compiled.append(formulas.Parser().ast("=" + fml)[1].compile())
        except Exception:  # noqa: BLE001 - upstream skips a rule whose formula does not parse
            return None
        args: list[Any] = []
        for c1, r1, c2, r2 in _ABSOLUTE_RANGE.findall(fml):
            if not c2:
                args.append(read_cell_value(xlsx, sheet, f"{c1}{r1}"))
            else:
                cells = CellRange(f"{c1}{r1}:{c2}{r2}").cells
                args.append(
                    [read_cell_value(xlsx, sheet, f"{get_column_letter(c)}{r}") for r, c in cells]
                )
        args_per.append(args)
    if rule.type in _TEXT_RULES:
        cond, args = compiled[0], args_per[0]
        return lambda v: bool(cond(v, *args))
    if rule.type == "cellIs":
        try:
            refs = [f() for f in compiled]
        except Exception:  # noqa: BLE001 - upstream skips a rule whose references fail
            return None
        return lambda v: _cf_operator(rule.operator, v, refs)
    return None


def load_xlsx_styles(book: Any, sheet: str, xlsx: str, **options: Any) -> dict[str, list[Any]]:
    """``{coordinate: [style values]}`` for ``options["props"]`` over the sheet's used grid, with
    the styles of active conditional formats applied (evaluated with ``formulas``, as upstream).
    """  # noqa: D205
    from openpyxl.utils import get_column_letter

    try:
        ws = book[sheet]
    except KeyError:
        return {}
    props = list(options.get("props", []))
    out = {
        c.coordinate: [read_cell_style(p, c) for p in props] for col in ws.iter_cols() for c in col
    }
    for fmt in ws.conditional_formatting:
        for rule in fmt.rules:
            test = _cf_condition(rule, xlsx, sheet)
            if test is None:
                continue
            empties = 0
            for rng in fmt.cells:
                for row, col in rng.cells:
                    value = read_cell_value(xlsx, sheet, f"{get_column_letter(col)}{row}")
                    if value is None:
                        empties += 1
                        if empties > 50:
                            break
                        continue
                    try:
                        active = test(value)
                    except Exception:  # noqa: BLE001 - a formula error leaves the cell inactive
                        active = False
                    if active:
                        cell = ws.cell(row=row, column=col)
                        out[cell.coordinate] = [read_cell_style(p, cell, rule.dxf) for p in props]
    return out


def sheet_csv_lines(book_path: str | Path, sheet: str) -> list[str] | None:
    """The printed sheet: ``<book stem>-<sheet>.csv`` beside the book (written by LibreOffice's
    CSV export in the task's postconfig), stripped lines without trailing blank ones, or None.
    """  # noqa: D205
    p = Path(book_path)
    csv_path = p.with_name(f"{p.with_suffix('').name}-{sheet}.csv")
    try:
        lines = read_lines_any_encoding(csv_path)
    except OSError:
        return None
    stripped = [ln.strip() for ln in lines]
    while stripped and not stripped[-1]:
        stripped.pop()
    return stripped


def data_validations(ws: Any) -> list[Any]:
    """The sheet's data-validation objects (openpyxl ``DataValidation``)."""
    return list(ws.data_validations.dataValidation)


def style_props(options: Mapping[str, Any]) -> list[str]:
    """The style property names a ``style`` rule asks for."""
    return list(options.get("props", []))

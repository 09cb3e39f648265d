"""compare_table (every rule type the tasks use), compare_csv, compare_conference_city_in_order.

Each rule gets a correct case and a near miss on workbooks from the fixture source; the scores
are upstream OSWorld's on the same files except the two documented differences of sheet_data.
"""

import pytest
from openpyxl.chart import BarChart, LineChart, Reference
from openpyxl.formatting.rule import CellIsRule, FormulaRule
from openpyxl.styles import Font, PatternFill
from openpyxl.worksheet.datavalidation import DataValidation

from osworld_jax.env.evaluators import METRICS, option_checker

compare_table = METRICS.get("compare_table")
ROWS = [["name", "score"], ["alice", 90], ["bob", 85.25]]


def data(r0="RI0", r1="EI0", **kw):
    return [{"type": "sheet_data", "sheet_idx0": r0, "sheet_idx1": r1, **kw}]


def test_sheet_data_and_sheet_name(src):
    a = src.xlsx("a.xlsx", {"Sheet1": ROWS})
    b = src.xlsx("b.xlsx", {"Sheet1": [["name", "score"], ["alice", 90], ["bob", 85.250001]]})
    c = src.xlsx("c.xlsx", {"Sheet1": [["name", "score"], ["alice", 91], ["bob", 85.25]]})
    assert compare_table(a, b, rules=data()) == 1.0  # equal at 4 decimals
    assert compare_table(a, b, rules=data(precision=6)) == 0.0
    assert compare_table(a, c, rules=data()) == 0.0
    assert compare_table(a, c, rules=data(0, "ENSheet1")) == 0.0
    assert compare_table(a, a, rules=data("RNSheet1", "ENSheet1")) == 1.0
    d = src.xlsx("d.xlsx", {"Data": ROWS})
    assert compare_table(a, d, rules=[{"type": "sheet_name"}]) == 0.0
    assert compare_table(a, a, rules=[{"type": "sheet_name"}]) == 1.0
    assert compare_table(a, d, rules=data("RNSheet2", "EI0")) == 0.0  # no such sheet
    assert compare_table(None, a, rules=data()) == 0.0
    assert compare_table(src.text("bad.xlsx", "not a zip"), a, rules=data()) == 0.0


def test_sheet_data_documented_differences(src):
    # 1.00001 rounds to 1.0 (float64) against the gold's 1 (int64): upstream's DataFrame.equals
    # fails on the dtype although every value is equal
    ints = src.xlsx("i.xlsx", {"S": [["n"], [1], [2]]})
    floats = src.xlsx("f.xlsx", {"S": [["n"], [1.00001], [2]]})
    assert compare_table(floats, ints, rules=data()) == 1.0
    assert compare_table(floats, ints, rules=data(precision=5)) == 0.0
    # ignore_case on sheet_data folds strings (upstream ignores the option there)
    upper = src.xlsx("u.xlsx", {"S": [["Name"], ["ALICE"]]})
    lower = src.xlsx("l.xlsx", {"S": [["name"], ["alice"]]})
    assert compare_table(upper, lower, rules=data(ignore_case=True)) == 1.0
    assert compare_table(upper, lower, rules=data()) == 0.0


def test_sheet_print_reads_the_csv_beside_each_book(src):
    a = src.xlsx("r/Book.xlsx", {"Sheet1": ROWS})
    e = src.xlsx("e/Book_gold.xlsx", {"Sheet1": ROWS})
    src.sheet_csv(a, "Sheet1", ["name,score", "alice,90.00", "bob,85.25", ""])
    src.sheet_csv(e, "Sheet1", ["NAME,score", "alice,90.00", "bob,85.25"])
    rule = {"type": "sheet_print", "sheet_idx0": "RNSheet1", "sheet_idx1": "ENSheet1"}
    assert compare_table(a, e, rules=[rule]) == 0.0  # "name" vs "NAME"
    assert compare_table(a, e, rules=[{**rule, "ignore_case": True}]) == 1.0
    src.sheet_csv(e, "Sheet1", ["name,score", "alice,90", "bob,85.25"])
    assert compare_table(a, e, rules=[rule]) == 0.0  # printed "90.00" vs "90"
    bare = src.xlsx("x/NoCsv.xlsx", {"Sheet1": ROWS})
    assert compare_table(bare, e, rules=[rule]) == 0.0  # no printed CSV for the result


def test_sheet_fuzzy(src):
    a = src.xlsx("a.xlsx", {"Sheet1": [["12 Main Rd", " +1 555"], ["Alice", "x"]]})
    e = src.xlsx("e.xlsx", {"Sheet1": [["12 main road", "1 555"], ["ALICE", "x"]]})
    rules = [
        {
            "range": ["A1:A1"],
            "type": "fuzzy_match",
            "threshold": 85,
            "normalization": [["Rd", "Road"]],
            "ignore_case": True,
        },
        {"range": ["A2:B2"], "type": "exact_match", "ignore_case": True},
    ]
    rule = {"type": "sheet_fuzzy", "sheet_idx0": "RNSheet1", "sheet_idx1": "ENSheet1"}
    assert compare_table(a, e, rules=[{**rule, "rules": rules}]) == 1.0
    strict = [{**rules[1], "ignore_case": False}]
    assert compare_table(a, e, rules=[{**rule, "rules": strict}]) == 0.0
    inc = [{"range": ["A2"], "type": "includes"}]  # result contains expected
    assert compare_table(a, e, rules=[{**rule, "rules": inc}]) == 0.0
    # an inline string that starts with a blank (as a library writes it) is read as upstream's
    # XML parser gives it (the attribute-carrying element's dict), which never equals the plain
    # text "1 555"; LibreOffice writes shared strings, read as plain text: " +" trimmed, equal
    b1 = [{"range": ["B1"], "type": "exact_match", "trim_leadings": " +"}]
    shared = 1.0 if src.name == "apps" else 0.0
    assert compare_table(a, e, rules=[{**rule, "rules": b1}]) == shared


def test_check_cell_value_and_styles(src):
    def edit(wb):
        ws = wb["Sheet1"]
        ws["A1"].font = Font(bold=True, color="FFFFFFFF")
        ws["A1"].fill = PatternFill("solid", fgColor="FF0000FF")
        ws.merge_cells("A3:C3")

    a = src.xlsx("a.xlsx", {"Sheet1": [["Title", 2.5], ["x", "=B1*2"], ["merged"]]}, edit=edit)
    cell = lambda coord, props: [  # noqa: E731
        {"type": "check_cell", "sheet_idx": 0, "coordinate": coord, "props": props}
    ]
    eq = lambda v: {"method": "eq", "ref": v}  # noqa: E731
    assert compare_table(a, None, rules=cell("A1", {"value": eq("Title")})) == 1.0
    assert (
        compare_table(a, None, rules=cell("B1", {"value": {"method": "approx:0.01", "ref": 2.5}}))
        == 1.0
    )
    styled = {"bgcolor": eq("FF0000FF"), "font_color": eq("FFFFFFFF"), "font_bold": eq(True)}
    assert compare_table(a, None, rules=cell("A1", styled)) == 1.0
    assert compare_table(a, None, rules=cell("A1", {**styled, "font_bold": eq(False)})) == 0.0
    assert compare_table(a, None, rules=cell("B3", {"merge": eq(True)})) == 1.0
    assert compare_table(a, None, rules=cell("A3", {"merge": eq(True)})) == 0.0  # first cell
    # the value of a formula cell is the cached value stored with it: a library writes none (the
    # value is None), LibreOffice stores what it computed
    cached = 1.0 if src.name == "apps" else 0.0
    assert compare_table(a, None, rules=cell("B2", {"value": eq(5.0)})) == cached
    # a regex on an empty cell raises upstream inside the rule -> 0
    assert compare_table(a, None, rules=cell("Z9", {"value": {"method": "re", "ref": ".*"}})) == 0.0


def _chart(kind, title=None, cols=(2, 2)):
    def edit(wb):
        ws = wb["Sheet1"]
        ch = kind()
        ch.add_data(
            Reference(ws, min_col=cols[0], max_col=cols[1], min_row=1, max_row=3),
            titles_from_data=True,
        )
        ch.set_categories(Reference(ws, min_col=1, min_row=2, max_row=3))
        if title:
            ch.title = title
        ws.add_chart(ch, "D2")

    return edit


def test_chart(src):
    rule = [
        {"type": "chart", "sheet_idx0": 0, "sheet_idx1": "EI0", "chart_props": ["type", "title"]}
    ]
    a = src.xlsx("a.xlsx", {"Sheet1": ROWS}, edit=_chart(BarChart, "Scores"))
    e = src.xlsx("e.xlsx", {"Sheet1": ROWS}, edit=_chart(BarChart, "Scores"))
    line = src.xlsx("l.xlsx", {"Sheet1": ROWS}, edit=_chart(LineChart, "Scores"))
    retitled = src.xlsx("t.xlsx", {"Sheet1": ROWS}, edit=_chart(BarChart, "Other"))
    none = src.xlsx("n.xlsx", {"Sheet1": ROWS})
    assert compare_table(a, e, rules=rule) == 1.0
    assert compare_table(line, e, rules=rule) == 0.0
    assert compare_table(retitled, e, rules=rule) == 0.0
    assert compare_table(none, e, rules=rule) == 0.0
    direction = [{**rule[0], "chart_props": ["type", "direction"]}]
    assert compare_table(a, e, rules=direction) == 1.0


def _pivot(row_field=0, data_field=2, subtotal="sum"):
    def edit(wb):
        from openpyxl.pivot.cache import (
            CacheDefinition,
            CacheField,
            CacheSource,
            SharedItems,
            WorksheetSource,
        )
        from openpyxl.pivot.record import RecordList
        from openpyxl.pivot.table import (
            DataField,
            FieldItem,
            Location,
            PivotField,
            RowColField,
            TableDefinition,
        )

        ws = wb.create_sheet("Sheet2")
        cache = CacheDefinition(
            cacheSource=CacheSource(
                type="worksheet", worksheetSource=WorksheetSource(ref="A1:C4", sheet="Sheet1")
            ),
            cacheFields=[CacheField(name=n, sharedItems=SharedItems()) for n in ("r", "p", "s")],
        )
        cache.records = RecordList()
        fields = [PivotField(showAll=False) for _ in range(3)]
        fields[row_field] = PivotField(
            axis="axisRow",
            showAll=False,
            items=[FieldItem(x=0), FieldItem(x=1), FieldItem(t="default")],
        )
        pt = TableDefinition(
            name="PivotTable1",
            cacheId=1,
            dataCaption="Values",
            location=Location(ref="A1:B4", firstHeaderRow=1, firstDataRow=1, firstDataCol=1),
            pivotFields=fields,
            rowFields=[RowColField(x=row_field)],
            dataFields=[DataField(name="Sum", fld=data_field, subtotal=subtotal)],
        )
        pt.cache = cache
        ws._pivots.append(pt)

    return edit


def test_pivot_table(src):
    rows = {
        "Sheet1": [["Region", "Rep", "Sales"], ["East", "a", 1], ["West", "b", 2], ["East", "c", 3]]
    }
    props = ["col_fields", "filter", "row_fields", "data_fields"]
    rule = [
        {
            "type": "pivot_table",
            "sheet_idx0": "RNSheet2",
            "sheet_idx1": "ENSheet2",
            "pivot_props": props,
        }
    ]
    a = src.xlsx("a.xlsx", rows, edit=_pivot())
    e = src.xlsx("e.xlsx", rows, edit=_pivot())
    avg = src.xlsx("v.xlsx", rows, edit=_pivot(subtotal="average"))
    by_rep = src.xlsx("p.xlsx", rows, edit=_pivot(row_field=1))
    assert compare_table(a, e, rules=rule) == 1.0
    assert compare_table(avg, e, rules=rule) == 0.0
    assert compare_table(by_rep, e, rules=rule) == 0.0


def test_style_with_conditional_formats(src):
    nums = {"Sheet1": [["v"], [1], [7], [3]]}

    def red_font(cells):
        def edit(wb):
            for c in cells:
                wb["Sheet1"][c].font = Font(color="FFFF0000")

        return edit

    def cf(rule):
        def edit(wb):
            wb["Sheet1"].conditional_formatting.add("A2:A4", rule)

        return edit

    red = Font(color="FFFF0000")
    style = [{"type": "style", "sheet_idx0": 0, "sheet_idx1": "EI0", "props": ["font_color"]}]
    gold = src.xlsx("gold.xlsx", nums, edit=red_font(["A3"]))
    # the same look by a "cell value > 5" format, by a formula format, by direct formatting
    by_cellis = src.xlsx(
        "c.xlsx", nums, edit=cf(CellIsRule(operator="greaterThan", formula=["5"], font=red))
    )
    by_formula = src.xlsx("f.xlsx", nums, edit=cf(FormulaRule(formula=["A2>5"], font=red)))
    wrong = src.xlsx("w.xlsx", nums, edit=red_font(["A4"]))
    assert compare_table(gold, gold, rules=style) == 1.0
    assert compare_table(by_cellis, gold, rules=style) == 1.0
    assert compare_table(by_formula, gold, rules=style) == 1.0
    assert compare_table(wrong, gold, rules=style) == 0.0
    too_many = src.xlsx(
        "m.xlsx", nums, edit=cf(CellIsRule(operator="greaterThan", formula=["2"], font=red))
    )
    assert compare_table(too_many, gold, rules=style) == 0.0


def test_freeze_zoom_rows_validation(src):
    def frozen(cell):
        def edit(wb):
            wb["Sheet1"].freeze_panes = cell

        return edit

    rule = [{"type": "freeze", "sheet_idx0": 0, "sheet_idx1": "EI0"}]
    a = src.xlsx("a.xlsx", {"Sheet1": ROWS}, edit=frozen("B2"))
    e = src.xlsx("e.xlsx", {"Sheet1": ROWS}, edit=frozen("B2"))
    off = src.xlsx("o.xlsx", {"Sheet1": ROWS}, edit=frozen("A2"))
    assert compare_table(a, e, rules=rule) == 1.0
    assert compare_table(off, e, rules=rule) == 0.0

    def zoom(wb):
        wb["Sheet1"].sheet_view.zoomScale = 250

    z = src.xlsx("z.xlsx", {"Sheet1": ROWS}, edit=zoom)
    assert (
        compare_table(z, None, rules=[{"type": "zoom", "sheet_idx": 0, "method": "lt", "ref": 260}])
        == 1.0
    )
    assert (
        compare_table(z, None, rules=[{"type": "zoom", "sheet_idx": 0, "method": "lt", "ref": 200}])
        == 0.0
    )

    def hide(row):
        def edit(wb):
            wb["Sheet1"].row_dimensions[row].hidden = True

        return edit

    rows = [{"type": "row_props", "sheet_idx0": 0, "sheet_idx1": "EI0", "props": ["hidden"]}]
    h2 = src.xlsx("h2.xlsx", {"Sheet1": ROWS}, edit=hide(2))
    h3 = src.xlsx("h3.xlsx", {"Sheet1": ROWS}, edit=hide(3))
    assert compare_table(h2, h2, rules=rows) == 1.0
    assert compare_table(h3, h2, rules=rows) == 0.0

    def validate(sqref, values):
        def edit(wb):
            dv = DataValidation(type="list", formula1=f'"{values}"')
            dv.add(sqref)
            wb["Sheet1"].add_data_validation(dv)

        return edit

    dv_rule = [
        {
            "type": "data_validation",
            "sheet_idx": 0,
            "dv_props": [
                {
                    "ranges": {"method": "spreadsheet_range", "ref": ["D2:D29", "D2:D1048576"]},
                    "type": {"method": "eq", "ref": "list"},
                    "formula1": {"method": "str_set_eq", "ref": ["Pass", "Fail", "Held"]},
                }
            ],
        }
    ]
    good = src.xlsx("dv.xlsx", {"Sheet1": ROWS}, edit=validate("D2:D40", "Pass,Fail,Held"))
    short = src.xlsx("dv2.xlsx", {"Sheet1": ROWS}, edit=validate("D2:D10", "Pass,Fail,Held"))
    other = src.xlsx("dv3.xlsx", {"Sheet1": ROWS}, edit=validate("D2:D40", "Pass,Fail"))
    assert compare_table(good, None, rules=dv_rule) == 1.0
    assert compare_table(short, None, rules=dv_rule) == 0.0
    assert compare_table(other, None, rules=dv_rule) == 0.0
    assert compare_table(src.xlsx("none.xlsx", {"Sheet1": ROWS}), None, rules=dv_rule) == 0.0


def test_filter(src):
    def auto(ref):
        def edit(wb):
            wb["Sheet1"].auto_filter.ref = ref

        return edit

    rule = [{"type": "filter", "sheet_idx0": 0, "sheet_idx1": "EI0"}]
    a = src.xlsx("a.xlsx", {"Sheet1": ROWS}, edit=auto("A1:B3"))
    b = src.xlsx("b.xlsx", {"Sheet1": ROWS}, edit=auto("A1:A3"))
    assert compare_table(a, a, rules=rule) == 1.0
    assert compare_table(b, a, rules=rule) == 0.0


def test_unsupported_rules_are_reported(src):
    check = option_checker(compare_table)
    assert check({"rules": [{"type": "sheet_data"}, {"type": "hologram"}]}) == [
        "compare_table rule hologram"
    ]
    a = src.xlsx("a.xlsx", {"Sheet1": ROWS})
    with pytest.raises(ValueError, match="hologram"):
        compare_table(a, a, rules=[{"type": "hologram", "sheet_idx0": 0, "sheet_idx1": 0}])
    # a book without sparklines equals another without
    spark = [{"type": "sparkline", "sheet_idx0": 0, "sheet_idx1": "EI0"}]
    assert compare_table(a, a, rules=spark) == 1.0


def test_without_pandas_or_openpyxl_its_tasks_are_not_runnable(monkeypatch):
    # compare_table opens every book (CSV ones too) with pandas and openpyxl: without them it
    # would score every result 0 (an unreadable book), so it says so before a task runs.
    import importlib.util

    from osworld_jax.env.evaluators import table

    real = importlib.util.find_spec
    check = option_checker(compare_table)
    rules = {"rules": [{"type": "sheet_data"}]}
    assert check(rules) == []
    monkeypatch.setattr(
        table.importlib.util, "find_spec", lambda m: None if m == "pandas" else real(m)
    )
    assert check(rules) == ["compare_table needs pandas (not installed)"]


def test_compare_csv_with_a_list_of_gold_files(src):
    f = METRICS.get("compare_csv")
    r = src.text("out.csv", "a,b\n1,2 \n")
    g1 = src.text("g1.csv", "a,b\n9,9\n")
    g2 = src.text("g2.csv", "a,b\n1,2 \n")
    assert f(r, [g1, g2]) == 1.0  # any gold file matches (it used to raise)
    assert f(r, [g1]) == 0.0
    assert f(r, g1) == 0.0
    assert f(r, src.text("g3.csv", "a,b\n1,2\n")) == 0.0  # strict: the trailing space counts
    assert f(r, src.text("g4.csv", "A,B\n1,2\n"), strict=False, ignore_case=True) == 1.0
    assert f(src.text("l1.csv", b"caf\xe9\n"), src.text("l2.csv", b"caf\xe9\n")) == 1.0  # Latin-1
    assert f(None, g1) == 0.0


def test_compare_csv_keeps_a_byte_order_mark_as_upstream(src):
    # Upstream's _safe_read_file tries "utf-8" first: a BOM stays as U+FEFF in the first line,
    # so only a file with the same BOM is equal (issue 29: we used to drop it and score 1).
    f = METRICS.get("compare_csv")
    plain = src.text("plain.csv", "a,b\n1,2\n")
    bom = src.text("bom.csv", "\ufeffa,b\n1,2\n")
    assert f(bom, plain) == 0.0  # the result has a BOM, the gold not
    assert f(plain, bom) == 0.0  # the gold has a BOM, the result not
    assert f(bom, src.text("bom2.csv", "\ufeffa,b\n1,2\n")) == 1.0  # both
    assert f(bom, plain, strict=False, ignore_case=True) == 0.0  # U+FEFF is not whitespace


def test_compare_conference_city_in_order(src):
    # Cells C2:C22 (21 rows) are checked in order against 21 expected entries.
    f = METRICS.get("compare_conference_city_in_order")
    cities = ["Singapore", "Montréal, Canada", "New Orleans"] + [f"City {i}" for i in range(18)]
    rows = [["Conf", "Year", "City"]] + [["c", 2024, c] for c in cities]
    book = src.xlsx("c.xlsx", {"Sheet1": rows})
    rest = [f"city {i}" for i in range(18)]
    assert (
        f(book, {"expected": ["singapore", ["Montreal", "Montréal"], "new orleans", *rest]}) == 1.0
    )
    assert f(book, {"expected": ["Singapore", "New Orleans", "Montreal", *rest]}) == 0.0  # order
    assert f(book, {"expected": ["Singapore", "Montreal", "New Orleans, LA", *rest]}) == 0.0
    assert f(book, {"expected": ["Singapore", "Montreal", "New Orleans"]}) == 0.0  # too few


def test_csv_books_for_the_bundled_tasks(src):
    # Extension (upstream cannot open a CSV book and scores 0): one sheet named after the stem.
    got = src.text("scores.csv", "name,score\nalice,90\nbob,85\n")
    gold = src.text("gold.csv", "name,score\nalice,90\nbob,85\n")
    off = src.text("off.csv", "name,score\nalice,90\nbob,84\n")
    assert compare_table(got, gold, rules=data()) == 1.0
    assert compare_table(off, gold, rules=data()) == 0.0
    cell = {"type": "check_cell", "sheet_idx": 0, "coordinate": "B3"}
    assert (
        compare_table(got, None, rules=[{**cell, "props": {"value": {"method": "eq", "ref": 85}}}])
        == 1.0
    )
    assert (
        compare_table(off, None, rules=[{**cell, "props": {"value": {"method": "eq", "ref": 85}}}])
        == 0.0
    )
    assert (
        compare_table(got, None, rules=[{"type": "freeze", "sheet_idx0": 0, "sheet_idx1": 0}])
        == 0.0
    )

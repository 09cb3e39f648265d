"""Each metric with hand-derived cases (expected values derived in the comments)."""

import json

import openpyxl
import pytest

from osworld_jax.env.evaluators import METRICS
from osworld_jax.env.evaluators.metrics import indel_ratio, match_value_to_rule


def m(name):
    return METRICS.get(name)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_exact_match():
    assert m("exact_match")("a\n", {"expected": "a\n"}) == 1.0
    assert m("exact_match")("a", {"expected": "a\n"}) == 0.0


def test_check_include_exclude():
    f = m("check_include_exclude")
    rules = {"include": ["spotify"], "exclude": ["not found"]}
    assert f("/usr/bin/spotify\n", rules) == 1.0
    assert f("spotify not found", rules) == 0.0  # excluded string present
    assert f("", rules) == 0.0  # included string missing
    assert f(None, rules) == 0.0
    assert f("anything", {}) == 1.0  # no constraints


def test_match_in_list_and_is_in_list():
    assert m("match_in_list")("dark", {"expected": ["dark", "Dark"]}) == 1.0
    assert m("match_in_list")("light", {"expected": ["dark"]}) == 0.0
    # is_in_list is the reverse containment: the expected item is in the result
    assert m("is_in_list")(["a", "b"], {"expected": "b"}) == 1.0
    assert m("is_in_list")("xyz", {"expected": "y"}) == 1.0
    assert m("is_in_list")(["a"], {"expected": "b"}) == 0.0
    assert m("is_in_list")(None, {"expected": "b"}) == 0.0


def test_literal_match():
    f = m("literal_match")
    assert f("Abc", "abc") == 0.0
    assert f("Abc", "abc", ignore_case=True) == 1.0
    assert f(["A", 1], ["a", "1"], type="list", ignore_case=True) == 1.0
    assert f("x", ["x"], type="list") == 0.0


def test_fuzzy_match_is_indel_ratio():
    # LCS("kitten", "sitting") = 4 ("ittn"): 2*4/(6+7) = 8/13
    assert indel_ratio("kitten", "sitting") == pytest.approx(8 / 13)
    assert m("fuzzy_match")("kitten", {"expected": "sitting"}) == pytest.approx(8 / 13)
    assert m("fuzzy_match")("same", {"expected": "same"}) == 1.0


def test_compare_text_file(tmp_path):
    f = m("compare_text_file")
    a = write(tmp_path, "a", "Hello  World\n")
    b = write(tmp_path, "b", "Hello World")
    c = write(tmp_path, "c", "hello world")
    assert f(a, a) == 1.0
    assert f(a, b) == 0.0
    assert f(a, b, ignore_blanks=True) == 1.0  # whitespace runs collapse, ends strip
    assert f(a, c, ignore_blanks=True) == 0.0
    assert f(a, c, ignore_blanks=True, ignore_case=True) == 1.0
    assert f(None, a) == 0.0


def test_diff_text_file(tmp_path):
    # lines [a,b,c,d] vs [a,b,x,d]: 3 matching of 8 total -> 2*3/8 = 0.75
    a = write(tmp_path, "a", "a\nb\nc\nd\n")
    b = write(tmp_path, "b", "a\nb\nx\nd\n")
    assert m("diff_text_file")(a, b) == pytest.approx(0.75)
    assert m("diff_text_file")(None, b) == 0.0


def test_check_list(tmp_path):
    f = m("check_list")
    p = write(tmp_path, "l", "apples\nbananas\n")
    assert f(p, {"expect": ["^apples$", "^ban"], "unexpect": ["durian"]}) == 1.0
    assert f(p, {"expect": ["^cherries$"]}) == 0.0
    assert f(p, {"expect": [], "unexpect": ["nana"]}) == 0.0


def test_file_contains_and_line_number(tmp_path):
    p = write(tmp_path, "f", "x\ny\nz\n")
    assert m("file_contains")(p, {"expected": ["y", "z"]}) == 1.0
    assert m("file_contains")(p, {"expected": ["w"]}) == 0.0
    assert m("check_line_number")(p, {"expected": "3"}) == 1.0
    assert m("check_line_number")(p, {"expected": 2}) == 0.0
    assert m("file_contains")(None, {"expected": []}) == 0.0


def test_check_csv(tmp_path):
    p = write(tmp_path, "c.csv", "item,price\ntea,4.50\ncoffee,3\n")
    f = m("check_csv")
    assert f(p, {"expect": [{"item": "tea", "price": "4.50"}]}) == 1.0
    assert f(p, {"expect": [{"item": "tea", "price": "4.5"}]}) == 0.0  # string compare
    assert f(p, {"unexpect": [{"item": "coffee"}]}) == 0.0


def test_compare_csv(tmp_path):
    a = write(tmp_path, "a.csv", "a,b\n1,2 \n")
    b = write(tmp_path, "b.csv", "a,b\n1,2\n")
    assert m("compare_csv")(a, b) == 0.0  # strict: trailing space differs
    assert m("compare_csv")(a, b, strict=False) == 1.0
    assert m("compare_csv")(None, b) == 0.0


def test_match_value_to_rule():
    assert match_value_to_rule("Hello", {"method": "re.I", "ref": "^hello$"})
    assert not match_value_to_rule("Hello", {"method": "re", "ref": "^hello$"})
    assert match_value_to_rule(3, {"method": "gt", "ref": 2})
    assert match_value_to_rule("1.004", {"method": "approx:0.01", "ref": 1})
    assert not match_value_to_rule("x", {"method": "approx:0.01", "ref": 1})
    assert match_value_to_rule([1, 2], {"method": "str_set_eq", "ref": ["2", "1"]})


def test_check_json_and_json_settings(tmp_path):
    p = write(tmp_path, "s.json", json.dumps({"editor": {"tabSize": 4}, "a": 1}))
    rules = {"expect": [{"key": ["editor", "tabSize"], "method": "eq", "ref": 4}]}
    assert m("check_json")(p, rules) == 1.0
    assert m("check_json")(p, {"expect": [{"key": ["nope"], "method": "eq", "ref": 1}]}) == 0.0
    assert m("check_json")(p, {"unexpect": [{"key": ["a"], "method": "eq", "ref": 1}]}) == 0.0
    assert m("check_json_settings")(p, {"expected": {"a": 1}}) == 1.0
    assert m("check_json_settings")(p, {"expected": {"a": 2}}) == 0.0


def test_check_direct_json_object():
    f = m("check_direct_json_object")
    assert f("{'a': 'x', 'b': 2}", {"expected": {"a": "x"}}) == 1.0
    assert f({"a": "y"}, {"expected": {"a": "x"}}) == 0.0
    assert f({"a": "the xyz"}, {"expected": {"a": "xyz"}, "expect_in_result": True}) == 1.0
    assert f("not json", {"expected": {"a": 1}}) == 0.0


def test_run_sqlite3(tmp_path):
    import sqlite3

    db = tmp_path / "d.db"
    con = sqlite3.connect(db)
    con.execute("create table t(x)")
    con.executemany("insert into t values (?)", [(1,), (2,)])
    con.commit()
    con.close()
    assert m("run_sqlite3")(str(db), {"sql": "select count(*) = 2 from t"}) == 1.0
    assert m("run_sqlite3")(str(db), {"sql": "select count(*) = 3 from t"}) == 0.0


def _xlsx(path, sheets):
    wb = openpyxl.Workbook()
    wb.remove(wb.active)
    for name, rows in sheets.items():
        ws = wb.create_sheet(name)
        for r in rows:
            ws.append(r)
    wb.save(path)
    return str(path)


def test_compare_table_csv_and_xlsx(tmp_path):
    f = m("compare_table")
    a = write(tmp_path, "a.csv", "name,score\nalice,90\nbob,85.00001\n")
    b = write(tmp_path, "b.csv", "name,score\nalice,90\nbob,85\n\n")
    rules = [{"type": "sheet_data", "sheet_idx0": "RI0", "sheet_idx1": "EI0"}]
    assert f(a, b, rules=rules) == 1.0  # 85.00001 rounds to 85 at precision 4
    assert f(a, b, rules=[{**rules[0], "precision": 6}]) == 0.0
    x = _xlsx(tmp_path / "x.xlsx", {"Sheet1": [["name", "score"], ["alice", 90], ["bob", 85]]})
    assert f(x, b, rules=rules) == 1.0  # xlsx vs csv compare alike
    y = _xlsx(tmp_path / "y.xlsx", {"Data": [["name", "score"], ["alice", 91], ["bob", 85]]})
    assert f(y, x, rules=rules) == 0.0
    assert f(y, x, rules=[{"type": "sheet_name"}]) == 0.0
    assert f(x, x) == 1.0  # no rules: names and all sheets' data
    cell = [
        {
            "type": "check_cell",
            "sheet_idx": 0,
            "coordinate": "B2",
            "props": {"value": {"method": "eq", "ref": 91}},
        }
    ]
    assert f(y, None, rules=cell) == 1.0
    assert f(x, None, rules=cell) == 0.0
    assert f(None, b, rules=rules) == 0.0
    bad = write(tmp_path, "bad.xlsx", "not a zip")
    assert f(bad, b, rules=rules) == 0.0


def test_compare_table_unsupported_rules_are_reported(tmp_path):
    from osworld_jax.env.evaluators import option_checker

    check = option_checker(m("compare_table"))
    assert check({"rules": [{"type": "sheet_data"}, {"type": "chart"}]}) == [
        "compare_table rule chart"
    ]
    with pytest.raises(ValueError, match="chart"):
        m("compare_table")(write(tmp_path, "a.csv", "a\n"), None, rules=[{"type": "chart"}])


def test_registered_metrics():
    # every registered metric has a test above (infeasible: test_evaluate.py)
    assert set(METRICS.names()) == {
        "check_csv", "check_direct_json_object", "check_image_file_size",
        "check_json_keybindings", "check_include_exclude", "check_json",
        "check_json_settings", "check_line_number", "check_list", "compare_csv", "compare_table",
        "compare_text_file", "diff_text_file", "exact_match", "file_contains", "fuzzy_match",
        "infeasible", "is_in_list", "literal_match", "match_in_list", "run_sqlite3",
    }  # fmt: skip


def test_check_json_keybindings_and_image_file_size(tmp_path):
    binding = {"key": "ctrl+j", "command": "workbench.action.focusActiveEditorGroup"}
    plain = write(tmp_path, "k.json", json.dumps([binding]))
    commented = write(
        tmp_path, "c.json", "// Place your key bindings here\n" + json.dumps([binding])
    )
    f = m("check_json_keybindings")
    assert f(plain, {"expected": binding}) == 1.0
    assert f(commented, {"expected": binding}) == 1.0
    assert f(plain, {"expected": {**binding, "key": "ctrl+k"}}) == 0.0
    assert f(write(tmp_path, "o.json", "{}"), {"expected": binding}) == 0.0  # not a list
    p = tmp_path / "img.bin"
    p.write_bytes(b"x" * 100)
    assert m("check_image_file_size")(str(p), {"max_size": 101}) == 1.0
    assert m("check_image_file_size")(str(p), {"max_size": 100}) == 0.0
    assert m("check_image_file_size")(None, {"max_size": 100}) == 0.0

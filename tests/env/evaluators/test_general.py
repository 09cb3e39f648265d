"""General metrics (text, lists, JSON, CSV): a correct case and a near miss each.

Expected scores are upstream OSWorld's (``desktop_env/evaluators/metrics/general.py`` and
``vscode.py``) on the same inputs; where upstream crashes the comment says so and we score 0.
"""

import json

import pytest

from osworld_jax.env.evaluators import METRICS
from osworld_jax.env.evaluators.metrics import indel_ratio
from osworld_jax.env.evaluators.rules import compare_urls, lists_equal, match_value_to_rule


def m(name):
    return METRICS.get(name)


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
    assert m("is_in_list")(None, {"expected": "b"}) == 0.0  # upstream: TypeError


def test_literal_match():
    f = m("literal_match")
    assert f("Abc", "abc") == 0.0
    assert f("Abc", "abc", ignore_case=True) == 1.0
    assert f(["A", 1], ["a", "1"], type="list", ignore_case=True) == 1.0
    assert f(["A"], ["A", "B"], type="list") == 0.0  # lengths differ
    assert f("x", ["x"], type="list") == 0.0


def test_fuzzy_match_is_indel_ratio():
    # LCS("kitten", "sitting") = 4 ("ittn"): 2*4/(6+7) = 8/13
    assert indel_ratio("kitten", "sitting") == pytest.approx(8 / 13)
    assert m("fuzzy_match")("kitten", {"expected": "sitting"}) == pytest.approx(8 / 13)
    assert m("fuzzy_match")("same", {"expected": "same"}) == 1.0
    # Upstream's fuzz.ratio raises TypeError on a number (no score): never a different
    # non-zero score here, so a non-string scores 0 (it was str(123) == "123": 1.0).
    assert m("fuzzy_match")(123, {"expected": "123"}) == 0.0
    assert m("fuzzy_match")("123", {"expected": 123}) == 0.0
    assert m("fuzzy_match")(None, {"expected": "x"}) == 0.0
    assert indel_ratio("", "") == 1.0


def test_compare_text_file(src):
    f = m("compare_text_file")
    a = src.text("a", "Hello  World\n")
    b = src.text("b", "Hello World")
    c = src.text("c", "hello world")
    assert f(a, a) == 1.0
    assert f(a, b) == 0.0
    assert f(a, b, ignore_blanks=True) == 1.0  # whitespace runs collapse, ends strip
    assert f(a, c, ignore_blanks=True) == 0.0
    assert f(a, c, ignore_blanks=True, ignore_case=True) == 1.0
    assert f(None, a) == 0.0


def test_text_metrics_read_non_utf8_as_no_answer(src):
    # Two different Latin-1 files: decoding with errors="replace" made both "\ufffd" and
    # scored them equal; upstream's strict UTF-8 read raises. Not UTF-8 -> 0, never equal.
    a = src.text("a.txt", b"caf\xe9\n")
    b = src.text("b.txt", b"caf\xe8\n")
    assert m("compare_text_file")(a, b) == 0.0
    assert m("compare_text_file")(a, a) == 0.0
    assert m("diff_text_file")(a, b) == 0.0
    assert m("file_contains")(a, {"expected": ["caf"]}) == 0.0  # upstream: except -> 0
    assert m("check_list")(a, {"expect": ["caf"]}) == 0.0


def test_diff_text_file(src):
    # lines [a,b,c,d] vs [a,b,x,d]: 3 matching of 8 total -> 2*3/8 = 0.75
    a = src.text("a", "a\nb\nc\nd\n")
    b = src.text("b", "a\nb\nx\nd\n")
    assert m("diff_text_file")(a, b) == pytest.approx(0.75)
    assert m("diff_text_file")(None, b) == 0.0


def test_check_list_lines_split_at_newline_only(src):
    f = m("check_list")
    p = src.text("l", "apples\nbananas\n")
    assert f(p, {"expect": ["^apples$", "^ban"], "unexpect": ["durian"]}) == 1.0
    assert f(p, {"expect": ["^cherries$"]}) == 0.0
    assert f(p, {"expect": [], "unexpect": ["nana"]}) == 0.0
    # a form feed is not a line break in file iteration (str.splitlines would split there)
    q = src.text("q", "a\x0cb\n")
    assert f(q, {"expect": ["^b"]}) == 0.0
    assert f(q, {"expect": ["^a\x0cb$"]}) == 1.0


def test_file_contains(src):
    p = src.text("f", "x\ny\nz\n")
    assert m("file_contains")(p, {"expected": ["y", "z"]}) == 1.0
    assert m("file_contains")(p, {"expected": ["w"]}) == 0.0
    assert m("file_contains")(None, {"expected": []}) == 0.0


def test_check_line_number_counts_timestamped_lines(src):
    # Task 2373b66a (sar report): upstream counts the lines holding a time HH:MM:SS, so a report
    # with header lines still has the expected number of sample lines.
    report = (
        "Linux 6.5.0 (host)\t03/04/24\t_x86_64_\t(2 CPU)\n"
        "\n"
        "12:00:01     CPU     %user     %nice   %system   %iowait    %steal     %idle\n"
        "12:00:02     all      1.00      0.00      0.50      0.00      0.00     98.50\n"
        "12:00:03     all      2.00      0.00      0.50      0.00      0.00     97.50\n"
        "Average:     all      1.50      0.00      0.50      0.00      0.00     98.00\n"
    )
    p = src.text("r.txt", report)
    f = m("check_line_number")
    assert f(p, {"expected": "3"}) == 1.0  # 3 timestamped lines of 6
    assert f(p, {"expected": "6"}) == 0.0  # every line: the old, wrong count
    assert f(src.text("t", "24:00:00 x\n23:59:60 y\n"), {"expected": 1}) == 1.0  # 24h is not a time
    assert f(p, {"expected": "three"}) == 0.0  # upstream: int() raises inside try -> 0
    assert f(None, {"expected": "0"}) == 0.0


def test_check_csv(src):
    p = src.text("c.csv", "item,price\ntea,4.50\ncoffee,3\n")
    f = m("check_csv")
    assert f(p, {"expect": [{"item": "tea", "price": "4.50"}]}) == 1.0
    assert f(p, {"expect": [{"item": "tea", "price": "4.5"}]}) == 0.0  # string compare
    assert f(p, {"unexpect": [{"item": "coffee"}]}) == 0.0


def test_match_value_to_rule_methods():
    assert match_value_to_rule("Hello", {"method": "re.I", "ref": "^hello$"})
    assert not match_value_to_rule("Hello", {"method": "re", "ref": "^hello$"})
    assert match_value_to_rule(3, {"method": "gt", "ref": 2})
    assert match_value_to_rule("1.004", {"method": "approx:0.01", "ref": 1})
    assert not match_value_to_rule("x", {"method": "approx:0.01", "ref": 1})
    # str_*_eq split a comma-separated string (a data validation's formula1 "Pass,Fail,Held")
    assert match_value_to_rule(
        '"Pass,Fail,Held"', {"method": "str_set_eq", "ref": ["Held", "Pass", "Fail"]}
    )
    assert not match_value_to_rule(
        '"Pass,Fail"', {"method": "str_list_eq", "ref": ["Fail", "Pass"]}
    )
    # range.XY: t = strict, e = or equal; (0, 2]
    assert match_value_to_rule(2, {"method": "range.te", "ref": [0, 2]})
    assert not match_value_to_rule(0, {"method": "range.te", "ref": [0, 2]})
    assert match_value_to_rule(
        "D2:D29", {"method": "spreadsheet_range", "ref": ["D2:D29", "D2:D1048576"]}
    )
    assert not match_value_to_rule(
        "D3:D29", {"method": "spreadsheet_range", "ref": ["D2:D29", "D2:D1048576"]}
    )
    # a regex on a non-string raises (upstream callers score that 0), never matches "None"
    with pytest.raises(TypeError):
        match_value_to_rule(None, {"method": "re", "ref": "None"})
    with pytest.raises(NotImplementedError):
        match_value_to_rule(1, {"method": "sorta", "ref": 1})


def test_compare_urls_and_lists_equal():
    assert compare_urls("https://www.airbnb.com.sg/s/homes", "https://airbnb.com/s/homes")
    assert compare_urls("example.com/", "http://example.com")
    assert not compare_urls("https://a.com/x?q=1", "https://a.com/x?q=2")
    assert compare_urls("https://a.com/x?q=1", "https://a.com/x?q=2", full=False)
    assert not compare_urls("https://maps.google.com", "https://google.com")
    assert compare_urls(None, None) and not compare_urls(None, "a.com")
    assert lists_equal(["a.com", "b.com"], ["http://b.com", "http://a.com"], compare_urls)
    assert not lists_equal(["a.com"], ["a.com", "b.com"], compare_urls)


def test_check_json(src):
    p = src.text("s.json", json.dumps({"editor": {"tabSize": 4}, "a": 1, "s": "dark"}))
    f = m("check_json")
    assert f(p, {"expect": [{"key": ["editor", "tabSize"], "method": "eq", "ref": 4}]}) == 1.0
    assert f(p, {"expect": [{"key": ["nope"], "method": "eq", "ref": 1}]}) == 0.0
    assert f(p, {"unexpect": [{"key": ["a"], "method": "eq", "ref": 1}]}) == 0.0
    assert f(p, {"unexpect": [{"key": ["zz"], "method": "eq", "ref": 1}]}) == 1.0
    # a regex rule on a number raises upstream -> 0 (it used to match str(4))
    assert f(p, {"expect": [{"key": ["editor", "tabSize"], "method": "re", "ref": "4"}]}) == 0.0
    assert f(src.text("bad.json", "{"), {"expect": []}) == 0.0


def test_check_json_yaml(src):
    # is_yaml reads YAML (it used to raise at evaluation); an empty document scores 0
    p = src.text("c.yaml", "model:\n  name: gpt\n  layers: 12\n")
    rules = {"expect": [{"key": ["model", "layers"], "method": "eq", "ref": 12}]}
    assert m("check_json")(p, rules, is_yaml=True) == 1.0
    assert m("check_json")(p, {"expect": [{**rules["expect"][0], "ref": 13}]}, is_yaml=True) == 0.0
    assert m("check_json")(src.text("e.yaml", ""), {"expect": []}, is_yaml=True) == 0.0
    assert m("check_json")(src.text("b.yaml", "a: [\n"), {"expect": []}, is_yaml=True) == 0.0


def test_check_json_settings(src):
    p = src.text("s.json", json.dumps({"a": 1}))
    assert m("check_json_settings")(p, {"expected": {"a": 1}}) == 1.0
    assert m("check_json_settings")(p, {"expected": {"a": 2}}) == 0.0
    assert m("check_json_settings")(None, {"expected": {"a": 1}}) == 0.0


def test_check_direct_json_object():
    f = m("check_direct_json_object")
    assert f("{'a': 'x', 'b': 2}", {"expected": {"a": "x"}}) == 1.0
    assert f({"a": "y"}, {"expected": {"a": "x"}}) == 0.0
    assert f("not json", {"expected": {"a": 1}}) == 0.0  # upstream: json.loads raises
    assert f(None, {"expected": {"a": 1}}) == 0.0
    assert f(["a"], {"expected": {"a": 1}}) == 0.0  # not an object
    assert f({"a": "x"}, {"expected": {"a": "__EVALUATION_FAILED__"}}) == 0.0
    # Task f5d96daf puts ignore_list_order beside "expected"; upstream reads the flag from
    # inside "expected", so there it has no effect and order matters.
    rules = {"expected": {"modelList": ["a", "b"]}, "ignore_list_order": True}
    assert f({"modelList": ["a", "b"]}, rules) == 1.0
    assert f({"modelList": ["b", "a"]}, rules) == 0.0


def test_check_direct_json_object_expect_in_result_lists_are_exact_alternatives():
    # Task ce2b64a2: a list of accepted names; "Kili" must not match the result "Kilimanjaro
    # Safari" by substring (it did), only an exact listed alternative scores.
    f = m("check_direct_json_object")
    rules = {"expected": {"h": ["Kili", "Kilimanjaro"]}, "expect_in_result": True}
    assert f({"h": "Kilimanjaro"}, rules) == 1.0
    assert f({"h": "Kilimanjaro Safari"}, rules) == 0.0
    assert f({"h": ["x", "Kili"]}, rules) == 1.0  # an element of a list result
    assert f({"h": 5}, rules) == 0.0
    # a string expected value is a substring test (of a string, or membership in a list)
    sub = {"expected": {"q": "coffee"}, "expect_in_result": True}
    assert f({"q": "drip coffee maker"}, sub) == 1.0
    assert f({"q": "tea"}, sub) == 0.0
    assert f({"q": None}, sub) == 0.0  # upstream: TypeError inside try -> 0
    assert f({"q": "x"}, {"expected": {"q": 3}, "expect_in_result": True}) == 0.0


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
    assert m("run_sqlite3")(str(db), {"sql": "select x from t where x > 5"}) == 0.0  # no row
    assert m("run_sqlite3")(None, {"sql": "select 1"}) == 0.0


def test_check_json_keybindings_and_image_file_size(src):
    binding = {"key": "ctrl+j", "command": "workbench.action.focusActiveEditorGroup"}
    plain = src.text("k.json", json.dumps([binding]))
    commented = src.text("c.json", "// Place your key bindings here\n" + json.dumps([binding]))
    f = m("check_json_keybindings")
    assert f(plain, {"expected": binding}) == 1.0
    assert f(commented, {"expected": binding}) == 1.0
    assert f(plain, {"expected": {**binding, "key": "ctrl+k"}}) == 0.0
    assert f(src.text("o.json", "{}"), {"expected": binding}) == 0.0  # not a list
    p = src.text("img.bin", b"x" * 100)
    assert m("check_image_file_size")(p, {"max_size": 101}) == 1.0
    assert m("check_image_file_size")(p, {"max_size": 100}) == 0.0
    assert m("check_image_file_size")(None, {"max_size": 100}) == 0.0

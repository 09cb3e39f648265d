"""OSWorld metrics over text, lists, JSON and command output (pure functions, no I/O but files).

Each metric follows the upstream function of the same name in
``desktop_env/evaluators/metrics`` (general.py, vscode.py, ...): ``metric(result, expected,
**options) -> float`` in [0, 1], where ``result`` / ``expected`` are what the getters returned
(a local file path for file getters, a string for command getters, the ``rules`` object for
``rule``). A ``None`` result (file missing, command silent) scores 0.
"""

from __future__ import annotations

import csv
import difflib
import functools
import json
import operator
import re
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from osworld_jax.env.evaluators.registry import METRICS


@METRICS.register("exact_match")
def exact_match(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``result == rules["expected"]``."""
    return float(result == rules["expected"])


@METRICS.register("check_include_exclude")
def check_include_exclude(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff every ``rules["include"]`` string is in ``result`` and no ``exclude`` string is."""
    if result is None:
        return 0.0
    include = rules.get("include", [])
    exclude = rules.get("exclude", [])
    return float(all(r in result for r in include) and all(r not in result for r in exclude))


@METRICS.register("match_in_list")
def match_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``result`` is one of ``rules["expected"]``."""
    return float(result in rules["expected"])


@METRICS.register("is_in_list")
def is_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``rules["expected"]`` is an element (or substring) of ``result``."""
    if result is None:
        return 0.0
    return float(rules["expected"] in result)


@METRICS.register("literal_match")
def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """String (``type="str"``) or list (``type="list"``) equality, optionally ignoring case."""
    kind = options.get("type", "str")
    fold = (lambda s: str(s).lower()) if options.get("ignore_case", False) else str
    if kind == "str":
        return float(fold(result) == fold(expected))
    if kind == "list":
        if not isinstance(result, list | tuple) or not isinstance(expected, list | tuple):
            return 0.0
        return float([fold(s) for s in result] == [fold(s) for s in expected])
    raise ValueError(f"literal_match: unsupported type {kind!r}")


def _lcs_len(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def indel_ratio(a: str, b: str) -> float:
    """Normalised indel similarity ``2·LCS(a, b) / (|a| + |b|)`` (rapidfuzz's ``fuzz.ratio``/100).

    >>> indel_ratio("abcd", "abxd")
    0.75
    """
    if not a and not b:
        return 1.0
    return 2.0 * _lcs_len(a, b) / (len(a) + len(b))


@METRICS.register("fuzzy_match")
def fuzzy_match(result: Any, rules: Mapping[str, Any]) -> float:
    """Indel similarity between ``result`` and ``rules["expected"]`` (a score in [0, 1])."""
    if result is None:
        return 0.0
    return indel_ratio(str(result), str(rules["expected"]))


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")


@METRICS.register("compare_text_file")
def compare_text_file(result: str | None, expected: str, **options: Any) -> float:
    """1 iff the two text files are equal.

    Options: ``ignore_blanks`` collapses whitespace runs to one space; ``ignore_case``.
    """
    if not result:
        return 0.0
    a, b = _read(result), _read(expected)
    if options.get("ignore_blanks", False):
        a = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", a).strip())
        b = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", b).strip())
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


@METRICS.register("diff_text_file")
def diff_text_file(result: str | None, expected: str) -> float:
    """Line-level ``difflib.SequenceMatcher`` ratio between the two files (partial credit)."""
    if result is None:
        return 0.0
    a, b = _read(result).splitlines(), _read(expected).splitlines()
    return difflib.SequenceMatcher(a=a, b=b).ratio()


@METRICS.register("file_contains")
def file_contains(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the file contains every string of ``rules["expected"]``."""
    if result is None or not Path(result).is_file():
        return 0.0
    text = _read(result)
    return float(all(s in text for s in rules["expected"]))


@METRICS.register("check_line_number")
def check_line_number(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the file has exactly ``int(rules["expected"])`` lines."""
    if result is None or not Path(result).is_file():
        return 0.0
    return float(len(_read(result).splitlines()) == int(rules["expected"]))


@METRICS.register("check_list")
def check_list(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff every ``expect`` regex matches some line and no ``unexpect`` regex matches any."""
    if result is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    found = [False] * len(expect)
    clean = True
    for line in _read(result).splitlines(keepends=True):
        for i, r in enumerate(expect):
            found[i] = found[i] or r.search(line) is not None
        clean = clean and all(r.search(line) is None for r in unexpect)
    return float(all(found) and clean)


def match_record(pattern: Mapping[str, Any], item: Mapping[str, Any]) -> bool:
    """Whether ``item`` has every key of ``pattern`` with an equal value."""
    return all(k in item and item[k] == v for k, v in pattern.items())


@METRICS.register("check_csv")
def check_csv(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff every ``expect`` record matches some CSV row and no ``unexpect`` record matches any.

    Records are dicts matched against ``csv.DictReader`` rows (string values).
    """
    if result is None:
        return 0.0
    expect = list(rules.get("expect", []))
    unexpect = list(rules.get("unexpect", []))
    found = [False] * len(expect)
    clean = True
    with open(result, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for i, r in enumerate(expect):
                found[i] = found[i] or match_record(r, row)
            clean = clean and not any(match_record(r, row) for r in unexpect)
    return float(all(found) and clean)


def match_value_to_rule(value: Any, rule: Mapping[str, Any]) -> bool:
    """Upstream's ``_match_value_to_rule``: ``{method, ref}`` with ``method`` one of ``eq ne le lt
    ge gt``, ``re[.FLAG...]`` (regex search), ``approx:TOL``, ``str_list_eq``, ``str_set_eq``.
    """  # noqa: D205
    method, ref = str(rule["method"]), rule["ref"]
    if method.startswith("re"):
        flags = functools.reduce(
            operator.or_, (getattr(re, f) for f in method.split(".")[1:]), re.RegexFlag(0)
        )
        return re.search(ref, str(value), flags) is not None
    if method in {"eq", "ne", "le", "lt", "ge", "gt"}:
        return bool(getattr(operator, method)(value, ref))
    if method.startswith("approx"):
        tol = float(method.split(":")[1])
        try:
            return abs(float(value) - float(ref)) <= tol
        except (TypeError, ValueError):
            return False
    if method == "str_list_eq":
        return [str(v) for v in value] == [str(r) for r in ref]
    if method == "str_set_eq":
        return {str(v) for v in value} == {str(r) for r in ref}
    raise ValueError(f"unsupported rule method {method!r}")


@METRICS.register("check_json")
def check_json(result: str | None, rules: Mapping[str, Any], is_yaml: bool = False) -> float:
    """1 iff every ``expect`` rule ``{key: [path...], method, ref}`` holds in the JSON file and no
    ``unexpect`` rule does (a missing key fails an ``expect`` rule). YAML files are unsupported.
    """  # noqa: D205
    if is_yaml:
        raise ValueError("check_json: is_yaml=true is not supported")
    if result is None or not Path(result).is_file():
        return 0.0
    try:
        data = json.loads(_read(result))
    except json.JSONDecodeError:
        return 0.0
    for r in rules.get("expect", []):
        value = data
        for k in r["key"]:
            try:
                value = value[k]
            except (KeyError, IndexError, TypeError):
                return 0.0
        if not match_value_to_rule(value, r):
            return 0.0
    for r in rules.get("unexpect", []):
        value = data
        for k in r["key"]:
            try:
                value = value[k]
            except (KeyError, IndexError, TypeError):
                value = None
                break
        if match_value_to_rule(value, r):
            return 0.0
    return 1.0


@METRICS.register("check_direct_json_object")
def check_direct_json_object(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff the JSON object ``result`` has every key/value of ``rules["expected"]``.

    A string result is parsed as JSON (single quotes accepted); with ``expect_in_result`` each
    expected value must instead be contained in the result's value.
    """
    if isinstance(result, str):
        try:
            result = json.loads(result.strip().replace("'", '"'))
        except json.JSONDecodeError:
            return 0.0
    if not isinstance(result, Mapping):
        return 0.0
    expected = rules["expected"]
    if rules.get("expect_in_result", False):
        for k, v in expected.items():
            got = result.get(k)
            if got is None:
                return 0.0
            vals = v if isinstance(v, list) else [v]
            if not any(str(x) in str(got) for x in vals):
                return 0.0
        return 1.0
    return float(all(result.get(k) == v for k, v in expected.items()))


@METRICS.register("check_json_settings")
def check_json_settings(result: str | None, expected: Mapping[str, Any]) -> float:
    """1 iff the JSON file holds every key/value of ``expected["expected"]``."""
    if not result or not Path(result).is_file():
        return 0.0
    try:
        data = json.loads(_read(result))
    except json.JSONDecodeError:
        return 0.0
    want = expected["expected"]
    return float(isinstance(data, dict) and all(data.get(k) == v for k, v in want.items()))


@METRICS.register("run_sqlite3")
def run_sqlite3(result: str | None, rules: Mapping[str, Any]) -> float:
    """The first column of the first row of ``rules["sql"]`` run on the database file."""
    if result is None:
        return 0.0
    con = sqlite3.connect(f"file:{result}?mode=ro", uri=True)
    try:
        row = con.execute(rules["sql"]).fetchone()
    finally:
        con.close()
    return float((row[0] if row else 0) or 0)


def _lines(path: str, options: Mapping[str, Any]) -> Sequence[str]:
    lines = _read(path).splitlines()
    if not options.get("strict", True):
        lines = [ln.strip() for ln in lines]
    if options.get("ignore_case", False):
        lines = [ln.lower() for ln in lines]
    return lines


@METRICS.register("compare_csv")
def compare_csv(result: str | None, expected: str, **options: Any) -> float:
    """1 iff the two CSV files have the same lines (``strict=False`` strips, ``ignore_case``)."""
    if result is None or not Path(result).is_file():
        return 0.0
    return float(_lines(result, options) == _lines(expected, options))


@METRICS.register("check_json_keybindings")
def check_json_keybindings(result: str | None, expected: Mapping[str, Any]) -> float:
    """1 iff the keybindings file (a JSON list, optionally after one comment line) contains
    ``expected["expected"]`` as an entry.
    """  # noqa: D205
    if not result or not Path(result).is_file():
        return 0.0
    text = _read(result)
    for candidate in (text, text.split("\n", 1)[1] if "\n" in text else ""):
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(data, list):
            return float(expected["expected"] in data)
    return 0.0


@METRICS.register("check_image_file_size")
def check_image_file_size(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the file exists and is smaller than ``rules["max_size"]`` bytes."""
    if result is None or not Path(result).is_file():
        return 0.0
    return float(Path(result).stat().st_size < rules["max_size"])


@METRICS.register("infeasible")
def infeasible(*args: Any, **kwargs: Any) -> float:
    """Scored from the agent's last action by ``evaluate_task`` (1 iff FAIL), never called."""
    raise TypeError("infeasible is scored by evaluate_task from the last action")

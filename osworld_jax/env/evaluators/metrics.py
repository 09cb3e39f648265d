"""OSWorld metrics over text, lists, JSON, CSV and command output (no jax).

Each metric follows the upstream function of the same name in ``desktop_env/evaluators/metrics``
(``general.py``, ``vscode.py``): ``metric(result, expected, **options) -> float`` in [0, 1],
where ``result`` / ``expected`` are what the getters returned (a local file path for file
getters, a string for command getters, the ``rules`` object for ``rule``).

Where upstream returns a score we return the same score. Where upstream crashes on an input
(``None`` from a getter whose file is missing, a file that is not UTF-8, a result string that is
not JSON) we return 0: such a result is not the answer. ``docs/EVALUATORS.md`` lists each case.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import re
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import match_record, match_value_to_rule, read_text

# Re-exported for callers that imported them from here before ``rules`` existed.
__all__ = ["indel_ratio", "match_record", "match_value_to_rule"]


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


def indel_ratio(a: str, b: str) -> float:
    """Normalised indel similarity ``2·LCS(a, b) / (|a| + |b|)`` (rapidfuzz's ``fuzz.ratio``/100).

    >>> indel_ratio("abcd", "abxd")
    0.75
    """
    from rapidfuzz import fuzz

    return float(fuzz.ratio(a, b)) / 100.0


@METRICS.register("fuzzy_match")
def fuzzy_match(result: Any, rules: Mapping[str, Any]) -> float:
    """Indel similarity between ``result`` and ``rules["expected"]`` (a score in [0, 1]).

    Both must be strings: upstream's ``fuzz.ratio(result, expected)`` raises ``TypeError`` on a
    number (``fuzzy_match(123, {"expected": "123"})``: no score), so a non-string scores 0 here,
    never the 1.0 that ``str(123)`` would give (docs/EVALUATORS.md: where upstream crashes).
    """
    expected = rules["expected"]
    if not isinstance(result, str) or not isinstance(expected, str):
        return 0.0
    return indel_ratio(result, expected)


def _read(path: str | None) -> str | None:
    return read_text(path)


@METRICS.register("compare_text_file")
def compare_text_file(result: str | None, expected: str, **options: Any) -> float:
    """1 iff the two text files are equal.

    Options: ``ignore_blanks`` turns tabs/newlines into spaces, strips, and collapses
    whitespace runs; ``ignore_case``.
    """
    a, b = _read(result), _read(expected)
    if a is None or b is None:
        return 0.0
    if options.get("ignore_blanks", False):
        a = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", a).strip())
        b = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", b).strip())
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


@METRICS.register("diff_text_file")
def diff_text_file(result: str | None, expected: str) -> float:
    """Line-level ``difflib.SequenceMatcher`` ratio between the two files (partial credit)."""
    a, b = _read(result), _read(expected)
    if a is None or b is None:
        return 0.0
    return difflib.SequenceMatcher(a=a.splitlines(), b=b.splitlines()).ratio()


@METRICS.register("file_contains")
def file_contains(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff the file contains every string of ``rules["expected"]``."""
    text = _read(result)
    if text is None:
        return 0.0
    return float(all(s in text for s in rules["expected"]))


# A wall-clock time ``HH:MM:SS``: upstream counts the lines that hold one (log lines).
_TIME_OF_DAY = re.compile(r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)")


@METRICS.register("check_line_number")
def check_line_number(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff exactly ``int(rules["expected"])`` lines of the file contain a time ``HH:MM:SS``."""
    text = _read(result)
    if text is None:
        return 0.0
    count = sum(1 for line in io.StringIO(text) if _TIME_OF_DAY.search(line))
    try:
        return float(count == int(rules["expected"]))
    except (TypeError, ValueError):
        return 0.0


@METRICS.register("check_list")
def check_list(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff every ``expect`` regex matches some line and no ``unexpect`` regex matches any."""
    text = _read(result)
    if text is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    found = [False] * len(expect)
    clean = True
    for line in io.StringIO(text):  # lines split at "\n" only, newline kept (file iteration)
        for i, r in enumerate(expect):
            found[i] = found[i] or r.search(line) is not None
        clean = clean and all(r.search(line) is None for r in unexpect)
    return float(all(found) and clean)


@METRICS.register("check_csv")
def check_csv(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff every ``expect`` record matches some CSV row and no ``unexpect`` record matches any.

    Records are dicts matched against ``csv.DictReader`` rows (string values).
    """
    text = _read(result)
    if text is None:
        return 0.0
    expect = list(rules.get("expect", []))
    unexpect = list(rules.get("unexpect", []))
    found = [False] * len(expect)
    clean = True
    for row in csv.DictReader(io.StringIO(text)):
        for i, r in enumerate(expect):
            found[i] = found[i] or match_record(r, row)
        clean = clean and not any(match_record(r, row) for r in unexpect)
    return float(all(found) and clean)


def _load_structured(path: str | None, is_yaml: bool) -> Any:
    text = _read(path)
    if text is None:
        return None
    if is_yaml:
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _lookup(data: Any, keys: Sequence[Any]) -> Any:
    for k in keys:
        data = data[k]
    return data


@METRICS.register("check_json")
def check_json(result: str | None, rules: Mapping[str, Any], is_yaml: bool = False) -> float:
    """1 iff every ``expect`` rule ``{key: [path...], method, ref}`` holds in the JSON (or YAML)
    file and no ``unexpect`` rule does.

    A missing key fails an ``expect`` rule and makes an ``unexpect`` rule see ``None``; a rule
    whose method cannot apply to the value (e.g. a regex on a number) scores 0, as upstream.
    An empty YAML document, unparsable JSON/YAML or a non-UTF-8 file scores 0.
    """  # noqa: D205
    data = _load_structured(result, is_yaml)
    if data is None:
        return 0.0
    ok = True
    try:
        for r in rules.get("expect", {}):
            try:
                value = _lookup(data, r["key"])
            except (KeyError, IndexError, TypeError):
                return 0.0
            ok = ok and match_value_to_rule(value, r)
        for r in rules.get("unexpect", {}):
            try:
                value = _lookup(data, r["key"])
            except (KeyError, IndexError, TypeError):
                value = None
            ok = ok and not match_value_to_rule(value, r)
    except Exception:  # noqa: BLE001 - upstream scores a rule that raises as 0
        return 0.0
    return float(ok)


_EVALUATION_FAILED = "__EVALUATION_FAILED__"


def _expect_in(want: Any, got: Any) -> bool:
    """One key of ``check_direct_json_object`` with ``expect_in_result``."""
    if isinstance(want, list):
        # Exact alternatives: a listed value must be an element of a list result, or equal a
        # string result (never a substring of it).
        if isinstance(got, list):
            return any(w in got for w in want)
        if isinstance(got, str):
            return any(w == got for w in want)
        return False
    if isinstance(want, str):
        try:
            return want in got  # a substring of a string, an element of a list
        except TypeError:
            return False
    return False


@METRICS.register("check_direct_json_object")
def check_direct_json_object(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff the JSON object ``result`` matches ``rules["expected"]`` key by key.

    A string result is parsed as JSON after replacing single quotes with double quotes
    (unparsable: 0). Without ``expect_in_result`` each expected value must equal the result's
    (when ``expected`` itself holds a truthy ``ignore_list_order`` entry, values are compared
    sorted). With ``expect_in_result``: a list of expected values is a set of exact
    alternatives (one must be an element of a list result or equal a string result); a string
    expected value must be a substring of the result's; other types score 0. An expected value
    ``"__EVALUATION_FAILED__"`` (a relative-time getter that failed) scores 0.
    """
    if isinstance(result, str):
        try:
            result = json.loads(result.strip().replace("'", '"'))
        except json.JSONDecodeError:
            return 0.0
    if result is None:
        return 0.0
    expected = rules.get("expected", {})
    if isinstance(expected, Mapping) and any(v == _EVALUATION_FAILED for v in expected.values()):
        return 0.0
    try:
        expected = rules["expected"]
        if not rules.get("expect_in_result", False):
            for key, want in expected.items():
                if expected.get("ignore_list_order", False):
                    if sorted(want) != sorted(result.get(key)):
                        return 0.0
                elif want != result.get(key):
                    return 0.0
            return 1.0
        return float(all(_expect_in(want, result.get(key)) for key, want in expected.items()))
    except Exception:  # noqa: BLE001 - not an object / incomparable values: upstream scores 0
        return 0.0


@METRICS.register("check_json_settings")
def check_json_settings(result: str | None, expected: Mapping[str, Any]) -> float:
    """1 iff the JSON file holds every key/value of ``expected["expected"]``."""
    data = _load_structured(result, False)
    if data is None:
        return 0.0
    want = expected["expected"]
    try:
        return float(all(k in data and data[k] == v for k, v in want.items()))
    except TypeError:
        return 0.0


@METRICS.register("check_json_keybindings")
def check_json_keybindings(result: str | None, expected: Mapping[str, Any]) -> float:
    """1 iff the keybindings file (a JSON list, optionally after one comment line) contains
    ``expected["expected"]`` as an entry.
    """  # noqa: D205
    text = _read(result)
    if text is None:
        return 0.0
    for candidate in (text, text.split("\n", 1)[1] if "\n" in text else ""):
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(data, list):
            return float(expected["expected"] in data)
    return 0.0


@METRICS.register("run_sqlite3")
def run_sqlite3(result: str | None, rules: Mapping[str, Any]) -> float:
    """The first column of the first row of ``rules["sql"]`` run on the database file.

    No row, or a file that is not a database, scores 0.
    """
    if result is None or not Path(result).is_file():
        return 0.0
    con = sqlite3.connect(f"file:{result}?mode=ro", uri=True)
    try:
        row = con.execute(rules["sql"]).fetchone()
    except sqlite3.DatabaseError:
        return 0.0
    finally:
        con.close()
    return float((row[0] if row else 0) or 0)


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

"""Desktop and mail metrics: GNOME settings, clipboard, file moves, Thunderbird, the a11y tree.

Follows upstream ``desktop_env/evaluators/metrics`` ``basic_os.py``, ``thunderbird.py`` and
``check_accessibility_tree`` of ``general.py``. One deliberate difference: upstream parses the
favourite-apps list with ``eval`` on text the desktop printed; we parse it with
``ast.literal_eval`` (the same lists, and desktop output never runs as code on the host).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Mapping
from typing import Any

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import match_record, match_value_to_rule, parse_xml, read_text


@METRICS.register("check_gnome_favorite_apps")
def check_gnome_favorite_apps(apps_str: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff the favourite apps (``['a.desktop', ...]`` as gsettings prints it) are the expected
    set, with the same count.
    """  # noqa: D205
    if apps_str is None:
        return 0.0
    try:
        apps = ast.literal_eval(apps_str.strip())
    except (ValueError, SyntaxError):
        return 0.0
    want = rule["expected"]
    return float(len(apps) == len(want) and set(apps) == set(want))


@METRICS.register("is_utc_0")
def is_utc_0(timedatectl_output: str | None) -> float:
    """1 iff the 4th line of ``timedatectl`` output (the time zone) ends in ``+0000)``."""
    if timedatectl_output is None:
        return 0.0
    lines = timedatectl_output.split("\n")
    return float(len(lines) > 3 and lines[3].endswith("+0000)"))


@METRICS.register("check_moved_jpgs")
def check_moved_jpgs(directory: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the directory tree's top-level entries are exactly the expected file names."""
    if directory is None:
        return 0.0
    names = [node["name"] for node in directory["children"]]
    want = rule["expected"]
    return float(len(names) == len(want) and set(names) == set(want))


@METRICS.register("is_in_vm_clickboard")
def is_in_vm_clickboard(config: Mapping[str, Any], terminal_output: str | None) -> float:
    """1 iff the clipboard text (a command's output) contains the expected string(s)."""
    if terminal_output is None:
        return 0.0
    want = config["expected"]
    if not isinstance(want, list):
        return float(want in terminal_output)
    return float(all(w in terminal_output for w in want))


# ------------------------------------------------------------------ Thunderbird

_PREF = re.compile(r'^user_pref\("(?P<key>(?:[^"]|\\")+)\", (?P<val>.+)\);$')


@METRICS.register("check_thunderbird_prefs")
def check_thunderbird_prefs(result: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff each ``expect`` pref of ``prefs.js`` matches its rule and no ``unexpect`` one does.

    The last ``user_pref("key", value);`` line of a key counts; values are JSON.
    """
    text = read_text(result)
    if text is None:
        return 0.0
    expect, unexpect = rule.get("expect", {}), rule.get("unexpect", {})
    found = dict.fromkeys(expect, False)
    clean = True
    for line in text.splitlines():
        m = _PREF.match(line.strip())
        if m is None:
            continue
        key, value = m.group("key"), json.loads(m.group("val"))
        if key in expect:
            found[key] = match_value_to_rule(value, expect[key])
        elif key in unexpect:
            clean = clean and not match_value_to_rule(value, unexpect[key])
    return float(all(found.values()) and clean)


_CONDITION = re.compile(
    r"\b(?:AND|OR) \((?:[\w ]+),(?:[\w ']+),(?:\"(?:(?:[^\"]|\")+)\"|(?:[^)]+))\)|\bALL\b"
)


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\\\", "\\")


def _filters(text: str) -> list[dict[str, Any]]:
    """Thunderbird's ``msgFilterRules.dat`` as dicts: name, enabled, type, action, actionValue,
    condition (the list of ``AND (...)`` / ``OR (...)`` / ``ALL`` terms).
    """  # noqa: D205
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    for line in text.splitlines(keepends=True):
        for key in ("name", "enabled", "type", "action", "actionValue"):
            if line.startswith(f"{key}="):
                if key == "name":
                    cur = {}
                cur[key] = _unescape(line[len(key) + 2 : -2])
                break
        else:
            if line.startswith("condition="):
                cur["condition"] = _CONDITION.findall(_unescape(line[11:-2]))
                out.append(cur)
    return out


@METRICS.register("check_thunderbird_filter")
def check_thunderbird_filter(result: str | None, rules: Mapping[str, Any]) -> float:
    """1 iff each ``expect`` record matches some filter and no ``unexpect`` record matches any."""
    text = read_text(result)
    if text is None:
        return 0.0
    filters = _filters(text)
    expect, unexpect = rules.get("expect", []), rules.get("unexpect", [])
    found = [any(match_record(r, f) for f in filters) for r in expect]
    clean = not any(match_record(r, f) for r in unexpect for f in filters)
    return float(all(found) and clean)


def _folder_key(path: str, options: Mapping[str, Any]) -> str:
    """Upstream's normal form of an mbox folder file.

    Upstream keeps only the blank pieces between ``FROM - `` separators (its filter skips every
    non-blank message), so the form records how many such pieces there are; we reproduce that.
    """
    text = (read_text(path) or "").strip()
    pieces = []
    for mail in text.split("FROM - "):
        if mail.strip():
            continue
        if options.get("remove_deleted", True) and re.search(r"X-Mozilla-Status: 000[89]", mail):
            continue
        pieces.append("FROM - " + mail.strip())
    if options.get("remove_duplicate", True):
        pieces = list(set(pieces))
    return "\n".join(sorted(pieces))


@METRICS.register("check_thunderbird_folder")
def check_thunderbird_folder(result: Any, reference: Any, **kwargs: Any) -> float:
    """Upstream's folder comparison (each file split at ``FROM - ``; see ``_folder_key``)."""
    if not isinstance(reference, list):
        result, reference = [result], [reference]
    for pred, gold in zip(result, reference, strict=False):
        if pred is None or _folder_key(pred, kwargs) != _folder_key(gold, kwargs):
            return 0.0
    return 1.0


# ------------------------------------------------------------------ accessibility tree

_A11Y_NS = {
    "ubuntu": {
        k: f"https://accessibility.ubuntu.example.org/ns/{v}"
        for k, v in (("st", "state"), ("attr", "attributes"), ("cp", "component"),
                     ("doc", "document"), ("docattr", "document/attributes"), ("txt", "text"),
                     ("val", "value"), ("act", "action"))
    },
}  # fmt: skip


@METRICS.register("check_accessibility_tree")
def check_accessibility_tree(
    result: str | None, rules: list[Mapping[str, Any]], osname: str = "ubuntu"
) -> float:
    """Product over rules of how well the tree's selected elements match.

    Each rule selects elements by ``xpath`` or CSS ``selectors`` (joined by commas); none
    selected scores 0. With ``text`` the rule scores the best element: 1 for an exact text
    (``exact``), else the rapidfuzz ratio; without ``text`` it scores 1.
    """
    from lxml.cssselect import CSSSelector
    from rapidfuzz import fuzz

    if result is None:
        return 0.0
    ns = _A11Y_NS[osname]
    root = parse_xml(result)
    total = 1.0
    for r in rules:
        if "xpath" in r:
            elements = root.xpath(r["xpath"], namespaces=ns)
        elif "selectors" in r:
            elements = CSSSelector(", ".join(r["selectors"]), namespaces=ns)(root)
        else:
            raise ValueError("check_accessibility_tree: a rule needs xpath or selectors")
        if not elements:
            return 0.0
        if "text" in r:
            if r["exact"]:
                score = max(float(operator.eq(r["text"], e.text or None)) for e in elements)
            else:
                score = max(fuzz.ratio(r["text"], e.text or "") / 100.0 for e in elements)
        else:
            score = 1.0
        total *= score
    return float(total)

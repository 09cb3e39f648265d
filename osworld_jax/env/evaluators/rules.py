"""Shared helpers of the metrics: value rules, record matching, text files, URLs (no jax).

``match_value_to_rule`` follows upstream ``metrics/utils._match_value_to_rule`` exactly,
including where it raises (a regex on a non-string, an ordering of ``None``): callers catch the
error where upstream's caller does, so a rule that upstream scores 0 scores 0 here too.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lxml import etree

from osworld_jax.env.urls import compare_urls

# Files the agent produced are parsed on the host: no entity expansion (no billion laughs, no
# external entity reading a host file into a compared value), no DTD loading, no network.
_SAFE_XML = etree.XMLParser(resolve_entities=False, load_dtd=False, no_network=True)


def parse_xml(data: bytes | str) -> Any:
    """The root element of an XML document from the desktop, parsed without entities or DTDs."""
    return etree.fromstring(data.encode() if isinstance(data, str) else data, _SAFE_XML)


def parse_xml_file(path: str | Path) -> Any:
    """``parse_xml`` of a file's bytes."""
    return parse_xml(Path(path).read_bytes())


def match_record(pattern: Mapping[str, Any], item: Mapping[str, Any]) -> bool:
    """Whether ``item`` has every key of ``pattern`` with an equal value."""
    return all(k in item and item[k] == v for k, v in pattern.items())


def _cell_ranges(value: Any) -> list[Any]:
    from openpyxl.worksheet.cell_range import MultiCellRange

    return list(value.ranges if isinstance(value, MultiCellRange) else MultiCellRange(value).ranges)


def _ranges_within(subset: Any, superset: Any) -> bool:
    from openpyxl.worksheet.cell_range import MultiCellRange

    sup = superset if isinstance(superset, MultiCellRange) else MultiCellRange(superset)
    return all(r in sup for r in _cell_ranges(subset))


def match_value_to_rule(value: Any, rule: Mapping[str, Any]) -> bool:
    """Whether ``value`` satisfies ``{"method": m, "ref": r}``.

    Methods: ``re[.FLAG...]`` (``re.search(ref, value)``; ``value`` must be a string), ``eq ne
    le lt ge gt`` (``operator.<m>(value, ref)``), ``approx:TOL`` (``|float(value) - ref| <=
    TOL``, False when ``value`` is not a number), ``range.XY`` with ``ref = [lo, hi]`` (``lo
    <X value <Y hi`` where X, Y are ``t`` (strict) or ``e`` (or equal)), ``spreadsheet_range``
    with ``ref = [inner, outer]`` (cell ranges: ``inner`` within ``value`` within ``outer``), and
    ``str_list_eq`` / ``str_set_eq`` (the string ``value``, outer quotes stripped, split at
    commas, equals ``ref`` as a list / set).

    Raises:
      TypeError: the value's type does not fit the method (e.g. a regex on ``None``).
      NotImplementedError: an unknown method.
    """
    method, ref = str(rule["method"]), rule["ref"]
    if method.startswith("re"):
        flags = functools.reduce(
            operator.or_, (getattr(re, f) for f in method.split(".")[1:]), re.RegexFlag(0)
        )
        if not isinstance(value, str):
            raise TypeError(f"rule {method}: expected a string, got {type(value).__name__}")
        return re.search(ref, value, flags) is not None
    if method in {"eq", "ne", "le", "lt", "ge", "gt"}:
        return bool(getattr(operator, method)(value, ref))
    if method.startswith("approx"):
        tol = float(method.split(":")[1])
        try:
            v = float(value)
        except (TypeError, ValueError):
            return False
        return bool(abs(v - ref) <= tol)
    if method == "spreadsheet_range":
        return _ranges_within(ref[0], value) and _ranges_within(value, ref[1])
    if method.startswith("range."):
        left, right = method[6], method[7]
        return bool(
            getattr(operator, "l" + left)(ref[0], value)
            and getattr(operator, "l" + right)(value, ref[1])
        )
    if method in {"str_list_eq", "str_set_eq"}:
        if not isinstance(value, str):
            raise TypeError(f"rule {method}: expected a string, got {type(value).__name__}")
        parts = value.strip("\"'").split(",")
        if method == "str_list_eq":
            return parts == list(ref)
        return set(parts) == set(ref)
    raise NotImplementedError(f"unsupported rule method {method!r}")


def read_text(path: str | Path | None) -> str | None:
    """The file's text as UTF-8 (universal newlines), or None when absent or not UTF-8.

    Upstream opens text files with the platform's UTF-8 and no error handler; where that raises
    upstream scores 0 (or crashes), so a file that is not UTF-8 reads as None and scores 0 here.
    """
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


# Upstream tries "utf-8" before "utf-8-sig": a byte-order mark is kept as U+FEFF (a CSV with a
# BOM equals only a CSV with the same BOM), never dropped.
_FALLBACK_ENCODINGS = ("utf-8", "latin-1")


def read_lines_any_encoding(path: str | Path) -> list[str]:
    """The file's lines, decoded as UTF-8 (a BOM kept as U+FEFF), else Latin-1 (never fails).

    Upstream ``table._safe_read_file``: its list of encodings starts with ``utf-8`` (so its
    ``utf-8-sig`` entry is never reached and a BOM stays in the first line) and reaches Latin-1,
    which decodes any byte string, so the later entries are never reached.

    Raises:
      OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    for enc in _FALLBACK_ENCODINGS:
        try:
            text = data.decode(enc)
        except UnicodeDecodeError:
            continue
        return text.replace("\r\n", "\n").replace("\r", "\n").splitlines()
    raise AssertionError("latin-1 decodes every byte string")


def lists_equal(a: Sequence[Any], b: Sequence[Any], same: Callable[[Any, Any], bool]) -> bool:
    """Upstream ``are_lists_equal``: same length and every item of ``a`` pairs with one of ``b``.

    Each item of ``a`` must be ``same`` as some item of ``b`` (items of ``b`` may be reused).
    """
    if len(a) != len(b):
        return False
    return all(any(same(x, y) for y in b) for x in a)


# URL comparison lives in ``osworld_jax.env.urls`` (setup steps use it too).
__all__ = ["compare_urls"]

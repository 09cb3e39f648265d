"""Chrome metrics: tabs, URLs, bookmarks, history, cookies, settings, desktop shortcuts.

Follows upstream ``desktop_env/evaluators/metrics/chrome.py``. URLs compare with
``rules.compare_urls`` (host reduced to its registrable name, ``www.`` and the public suffix
dropped). The inputs are what the Chrome getters return (``getters_chrome``).
"""

from __future__ import annotations

import itertools
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import compare_urls, lists_equal


def _url_of(info: Any) -> Any:
    return info.get("url") if isinstance(info, Mapping) else info


@METRICS.register("is_expected_active_tab")
def is_expected_active_tab(active_tab: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the active tab's URL equals ``rule["url"]`` (``type: url``; compare_urls)."""
    if not active_tab or rule["type"] != "url":
        return 0.0
    return float(compare_urls(rule["url"], _url_of(active_tab)))


@METRICS.register("is_expected_active_tab_approximate")
def is_expected_active_tab_approximate(active_tab: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the active tab's URL equals ``rule["url"]`` with both query strings dropped."""
    if not active_tab or rule["type"] != "url":
        return 0.0

    def strip(u: str) -> str:
        return urllib.parse.urlunparse(urllib.parse.urlparse(u)._replace(query=""))

    return float(strip(rule["url"]) == strip(_url_of(active_tab)))


@METRICS.register("is_expected_url_pattern_match")
def is_expected_url_pattern_match(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff every regex of ``rules["expected"]`` is found in the URL (a string, or a dict's
    ``url``).
    """  # noqa: D205
    if not result:
        return 0.0
    if isinstance(result, str):
        url = result
    elif isinstance(result, dict) and "url" in result:
        url = result["url"]
    else:
        return 0.0
    return float(all(re.search(p, url) for p in rules["expected"]))


_ALIASES = ({"Zoom Chrome Extension", "Zoom for Google Chrome"},)


def _canonical(name: str) -> str:
    for group in _ALIASES:
        if name in group:
            return sorted(group)[0]
    return name


@METRICS.register("is_expected_installed_extensions")
def is_expected_installed_extensions(installed: Any, expected: Mapping[str, Any]) -> float:
    """1 iff every expected extension name is installed (known aliases equal)."""
    if not installed:
        return 0.0
    want = {_canonical(n) for n in expected["expected"]}
    return float(want <= {_canonical(n) for n in installed})


@METRICS.register("is_expected_tabs")
def is_expected_tabs(open_tabs: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the open tabs' URLs are ``rule["urls"]`` (same count, each one matched)."""
    if not open_tabs or rule["type"] != "url":
        return 0.0
    return float(lists_equal(rule["urls"], [t["url"] for t in open_tabs], compare_urls))


@METRICS.register("is_expected_bookmarks")
def is_expected_bookmarks(bookmarks: Any, rule: Mapping[str, Any]) -> float:
    """Bookmark-bar checks: folder names, site URLs, or the URLs of a "Liked Authors" folder.

    ``bookmark_bar_folders_names`` / ``bookmark_bar_websites_urls`` compare sets;
    ``liked_authors_websites_urls`` needs the folder to hold exactly one of each listed
    alternative set of URLs (a string is a one-element list).
    """
    if not bookmarks:
        return 0.0
    bar = bookmarks["bookmark_bar"]["children"]
    kind = rule["type"]
    if kind == "bookmark_bar_folders_names":
        return float({b["name"] for b in bar if b["type"] == "folder"} == set(rule["names"]))
    if kind == "bookmark_bar_websites_urls":
        return float({b["url"] for b in bar if b["type"] == "url"} == set(rule["urls"]))
    if kind == "liked_authors_websites_urls":
        folder = next(
            (b for b in bar if b["type"] == "folder" and b["name"] == "Liked Authors"), None
        )
        if folder is None:
            return 0.0
        urls = [b["url"] for b in folder["children"] if b["type"] == "url"]
        options = [[u] if isinstance(u, str) else list(u) for u in rule["urls"]]
        return float(any(set(c) == set(urls) for c in itertools.product(*options)))
    raise TypeError(f"is_expected_bookmarks: {kind} not supported")


@METRICS.register("is_expected_search_query")
def is_expected_search_query(active_tab: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``rules["expect"]["pattern"]`` is found in the active tab's URL."""
    if not active_tab:
        return 0.0
    return float(re.search(rules["expect"]["pattern"], active_tab["url"]) is not None)


@METRICS.register("is_cookie_deleted")
def is_cookie_deleted(cookies: Any, rule: Mapping[str, Any]) -> float:
    """1 iff no cookie's host (column 1 of a ``cookies`` row) matches a listed domain."""
    if rule["type"] != "domains":
        raise TypeError(f"is_cookie_deleted: {rule['type']} not supported")
    hosts = [c[1] for c in cookies]
    return float(not any(compare_urls(d, h) for d in rule["domains"] for h in hosts))


@METRICS.register("check_history_deleted")
def check_history_deleted(history: Any, rule: Mapping[str, Any]) -> float:
    """1 iff no history URL (column 0) contains a listed keyword."""
    if rule["type"] != "keywords":
        raise TypeError(f"check_history_deleted: {rule['type']} not supported")
    urls = [h[0] for h in history]
    return float(not any(k in u for k in rule["keywords"] for u in urls))


def _desktop_field(content: str, field: str) -> list[str]:
    return [ln[len(field) + 1 :] for ln in content.split("\n") if ln.startswith(field + "=")]


@METRICS.register("is_shortcut_on_desktop")
def is_shortcut_on_desktop(shortcuts: Mapping[str, str], rule: Mapping[str, Any]) -> float:
    """1 iff a desktop ``.desktop`` file's ``Name`` (``type: name``) or ``Exec`` matches.

    A match is equality or containment either way (names case-insensitively).
    """
    kind = rule["type"]
    if kind not in ("name", "exec"):
        raise TypeError(f"is_shortcut_on_desktop: {kind} not supported")
    field = "Name" if kind == "name" else "Exec"
    want = rule[kind]
    for content in shortcuts.values():
        if f"{field}={want}\n" in content:
            return 1.0
        for got in _desktop_field(content, field):
            if kind == "name":
                if got == want or want.lower() in got.lower() or got.lower() in want.lower():
                    return 1.0
            elif got == want or want in got or got in want:
                return 1.0
    return 0.0


@METRICS.register("check_font_size")
def check_font_size(font_size: Mapping[str, Any], rule: Mapping[str, Any]) -> float:
    """Chrome's default font size: equal to ``rule["value"]`` or strictly inside (min, max)."""
    size = font_size["default_font_size"]
    if rule["type"] == "value":
        return float(size == rule["value"])
    if rule["type"] == "range":
        return float(rule["min"] < size < rule["max"])
    raise TypeError(f"check_font_size: {rule['type']} not supported")


@METRICS.register("is_added_to_steam_cart")
def is_added_to_steam_cart(active_tab: Mapping[str, Any], rule: Mapping[str, Any]) -> float:
    """1 iff every listed item name appears in the active tab's page content."""
    return float(all(item in active_tab["content"] for item in rule["items"]))

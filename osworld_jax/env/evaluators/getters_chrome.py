"""Chrome getters: profile files, open tabs (DevTools), the active tab's URL (accessibility tree).

Follow upstream ``desktop_env/evaluators/getters/chrome.py`` on Linux: the profile is
``~/.config/google-chrome`` (the local desktop's Chromium runs with that profile directory and the
``google-chrome`` command name), files are read through the in-VM protocol, and the DevTools
endpoint is queried from inside the desktop (``run_python``; port 9222, else the tasks' 1337), so
it works where the desktop's network is private. Getters that must load a live web page
(``page_info``, ``pdf_from_url``, ...) are not here: ``capabilities`` reports them as needing the
web.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from lxml import etree
from lxml.cssselect import CSSSelector

from osworld_jax.env import setup
from osworld_jax.env.desktop_python import run_python
from osworld_jax.env.evaluators.getters import _fetch, _scratch
from osworld_jax.env.evaluators.registry import GETTERS, EvalContext
from osworld_jax.env.evaluators.rules import parse_xml
from osworld_jax.env.protocol import VMProtocol

PROFILE = "~/.config/google-chrome"
PREFERENCES = f"{PROFILE}/Default/Preferences"


async def _json_file(vm: VMProtocol, path: str) -> Any:
    """The parsed JSON of a desktop file (``None`` when missing; raises on bad JSON)."""
    data = await _fetch(vm, path)
    return None if data is None else json.loads(data)


def _preference_getter(name: str, read: Callable[[Any], Any], fallback: Any) -> None:
    """Registers a getter of one value of Chrome's ``Preferences`` (``fallback`` on any error)."""

    async def getter(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
        try:
            return read(await _json_file(vm, PREFERENCES))
        except Exception:  # noqa: BLE001 - upstream returns its fallback on any error
            return fallback

    getter.__name__ = getter.__qualname__ = name
    getter.__doc__ = f"Chrome's ``Preferences``: {name} (``{fallback!r}`` when unreadable)."
    GETTERS.add(name, getter)


_WEBPREFS = {"default_fixed_font_size": 13, "default_font_size": 16, "minimum_font_size": 13}
_preference_getter(
    "default_search_engine",
    lambda d: (
        d.get("default_search_provider_data", {})
        .get("template_url_data", {})
        .get("short_name", "Google")
    ),
    "Google",
)
_preference_getter("profile_name", lambda d: d.get("profile", {}).get("name", None), None)
_preference_getter(
    "chrome_font_size",
    lambda d: d.get("webkit", {}).get("webprefs", dict(_WEBPREFS)),
    {"default_fixed_font_size": 13, "default_font_size": 16},
)
_preference_getter(
    "enable_do_not_track",
    lambda d: "true" if d.get("enable_do_not_track", {}) else "false",
    "false",
)
_preference_getter(
    "enable_enhanced_safety_browsing",
    lambda d: "true" if d.get("safebrowsing", {}).get("enhanced", {}) else "false",
    "Google",
)
_preference_getter(
    "enable_safe_browsing",
    lambda d: (
        "true"
        if bool(d.get("safebrowsing", {}).get("enhanced", False))
        or bool(d.get("safebrowsing", {}).get("enabled", False))
        else "false"
    ),
    "false",
)
_preference_getter(
    "new_startup_page",
    lambda d: (
        "true"
        if "session" not in d
        else ("true" if d.get("session", {}).get("restore_on_startup", {}) == 5 else "false")
    ),
    "Google",
)
_preference_getter(
    "find_unpacked_extension_path",
    lambda d: [e["path"] for e in d.get("extensions", {}).get("settings", {}).values()],
    "Google",
)
_preference_getter(
    "find_installed_extension_name",
    lambda d: [e["manifest"]["name"] for e in d.get("extensions", {}).get("settings", {}).values()],
    "Google",
)
_preference_getter(
    "data_delete_automacally",
    lambda d: (
        "false" if d["profile"].get("default_content_setting_values", None) is None else "true"
    ),
    "Google",
)


@GETTERS.register("enabled_experiments")
async def enabled_experiments(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The ``browser.enabled_labs_experiments`` of Chrome's ``Local State`` ([] if unreadable)."""
    try:
        return (
            (await _json_file(vm, f"{PROFILE}/Local State"))
            .get("browser", {})
            .get("enabled_labs_experiments", [])
        )
    except Exception:  # noqa: BLE001
        return []


@GETTERS.register("bookmarks")
async def bookmarks(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The ``roots`` of Chrome's ``Bookmarks`` file ([] when the file is missing or empty)."""
    data = await _fetch(vm, f"{PROFILE}/Default/Bookmarks")
    if not data:
        return []
    return json.loads(data).get("roots", {})


async def _sqlite_rows(vm: VMProtocol, path: str, dest: str, ctx: EvalContext, sql: str) -> Any:
    try:
        data = await _fetch(vm, path)
        if data is None:
            return None
        target = _scratch(ctx, dest)
        target.write_bytes(data)
        con = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
        try:
            return con.execute(sql).fetchall()
        finally:
            con.close()
    except Exception:  # noqa: BLE001 - upstream returns None on any error
        return None


@GETTERS.register("cookie_data")
async def cookie_data(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """Every row of Chrome's ``Cookies`` table (None when unreadable)."""
    return await _sqlite_rows(
        vm, f"{PROFILE}/Default/Cookies", str(params["dest"]), ctx, "SELECT * FROM cookies"
    )


@GETTERS.register("history")
async def history(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """``(url, title, last_visit_time)`` rows of Chrome's ``History`` (None when unreadable)."""
    return await _sqlite_rows(
        vm,
        f"{PROFILE}/Default/History",
        str(params["dest"]),
        ctx,
        "SELECT url, title, last_visit_time FROM urls",
    )


_SHORTCUTS = """
import json, os
d = os.path.expanduser("~/Desktop")
out = {}
if os.path.isdir(d):
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if name.endswith(".desktop") and os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                out[name] = f.read()
print(json.dumps(out))
"""


@GETTERS.register("shortcuts_on_desktop")
async def shortcuts_on_desktop(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """``{file name: content}`` of the ``.desktop`` files on the desktop user's Desktop."""
    return await run_python(vm, _SHORTCUTS)


# ------------------------------------------------------------------ DevTools and the a11y tree

_DEVTOOLS_PAGES = """
import json, sys, urllib.request
out = None
for port in sys.argv[1:]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
            out = [{"title": t.get("title", ""), "url": t.get("url", "")}
                   for t in json.load(r) if t.get("type") == "page"]
        break
    except Exception:
        continue
print(json.dumps(out))
"""


@GETTERS.register("open_tabs_info")
async def open_tabs_info(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """``[{"title", "url"}]`` of Chrome's open tabs (its DevTools page targets); [] if closed."""
    tabs = await run_python(vm, _DEVTOOLS_PAGES, *setup.DEVTOOLS_PORTS)
    return tabs if tabs is not None else []


_A11Y_NS = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
}
# Google Chrome on OSWorld's VM; Chromium (standing in for it) names its application so.
_ADDRESS_BARS = [
    CSSSelector(
        f"application[name={app}] entry[name=Address\\ and\\ search\\ bar]", namespaces=_A11Y_NS
    )
    for app in ("Google\\ Chrome", "Chromium")
]


def active_url_from_tree(tree: str | None, goto_prefix: str = "https://") -> str | None:
    """The address bar's text with ``goto_prefix`` (the bar shows URLs without the scheme)."""
    if tree is None:
        return None
    try:
        root = parse_xml(tree)
    except (ValueError, etree.XMLSyntaxError):
        return None
    for sel in _ADDRESS_BARS:
        found = sel(root)
        if found:
            if not found[-1].text:
                return None
            return f"{goto_prefix}{found[0].text}"
    return None


async def _active_url(vm: VMProtocol, params: Mapping[str, Any]) -> str | None:
    return active_url_from_tree(await vm.accessibility(), params.get("goto_prefix", "https://"))


@GETTERS.register("active_url_from_accessTree")
async def active_url_from_access_tree(
    vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext
) -> Any:
    """The active tab's URL as Chrome's address bar shows it (``goto_prefix`` + its text)."""
    return await _active_url(vm, params)


@GETTERS.register("active_tab_url_parse")
async def active_tab_url_parse(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """``{key: first query value or ""}`` of the active URL for ``parse_keys``; ``replace``
    renames keys, ``split_list`` splits values at commas.
    """  # noqa: D205
    url = await _active_url(vm, params)
    if url is None:
        return None
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    out: dict[str, Any] = {k: query.get(k, [""])[0] for k in params["parse_keys"]}
    for old, new in params.get("replace", {}).items():
        out[new] = out.pop(old)
    if params.get("split_list", False):
        return {k: v.split(",") for k, v in out.items()}
    return out


@GETTERS.register("url_dashPart")
async def url_dash_part(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """Part ``partIndex`` of the active URL split at ``/`` (``needDeleteId`` drops a query),
    as a string or ``{key: part}`` (``returnType``).
    """  # noqa: D205
    url = await _active_url(vm, params)
    if url is None:
        return None
    try:
        index = int(params["partIndex"])
    except (ValueError, TypeError):
        return None
    parts = url.split("/")
    if index >= len(parts):
        return None
    part = parts[index]
    if params.get("needDeleteId", False):
        part = part.split("?")[0]
    if params["returnType"] == "string":
        return part
    if params["returnType"] == "json":
        return {params["key"]: part}
    return None


def macys_path_facts(url: str, parse_keys: list[str]) -> dict[str, Any]:
    """Upstream ``get_macys_product_url_parse``: facts of a Macy's product-list URL path."""
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
    out: dict[str, Any] = {"mens_clothing": True if "mens-clothing" in path else None}
    parts = path.strip("/").split("/")
    facets: dict[str, Any] = {}
    shirts, short_sleeve = "shirts" in path, "short-sleeve" in path
    for i in range(len(parts) - 1):
        if "," in parts[i] and "," in parts[i + 1]:
            keys = [k.strip() for k in parts[i].split(",")]
            values = [v.strip() for v in parts[i + 1].split(",")]
            for k, v in zip(keys, values, strict=False):
                if k == "Price_discount_range":
                    facets[k] = [x.strip() for x in v.split("|")] if v else None
                else:
                    facets[k] = v if v else None
                if k == "Product_department" and v in ("shirts", "Shirts", "Shirt"):
                    shirts = True
                if k == "Sleeve_length" and v in ("short-sleeve", "Short Sleeve"):
                    short_sleeve = True
            break
    for field in ("Men_regular_size_t", "Price_discount_range"):
        facets.setdefault(field, None)
    out["shirts"] = True if shirts else None
    out["short_sleeve"] = True if short_sleeve else None
    for key in parse_keys:
        if key not in facets:
            continue
        if key == "Price_discount_range":
            v = facets[key]
            only_50 = (
                v is not None
                and "50_PERCENT_ off & more" in v
                and "30_PERCENT_ off & more" not in v
                and "20_PERCENT_ off & more" not in v
            )
            out[key] = "50_PERCENT_ off & more" if only_50 else "not_50_PERCENT_ off & more"
        else:
            out[key] = facets[key]
    return out


async def _macys(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    url = await _active_url(vm, params)
    return None if url is None else macys_path_facts(url, list(params["parse_keys"]))


GETTERS.add("url_path_parse", _macys)
GETTERS.add("macys_product_url_parse", _macys)

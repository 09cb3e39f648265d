"""Chrome metrics (upstream ``metrics/chrome.py``) on what the Chrome getters return."""

import pytest

from osworld_jax.env.evaluators import METRICS


def m(name):
    return METRICS.get(name)


def test_active_tab_and_url_patterns():
    f = m("is_expected_active_tab")
    tab = {"title": "Flights", "url": "https://www.delta.com/flight-search/book-a-flight"}
    assert f(tab, {"type": "url", "url": "https://delta.com/flight-search/book-a-flight"}) == 1.0
    assert f(tab, {"type": "url", "url": "https://delta.com/flight-search"}) == 0.0
    assert (
        f("https://delta.com/x", {"type": "url", "url": "https://www.delta.com/x"}) == 1.0
    )  # a str
    assert f("https://delta.com/x", {"type": "url", "url": "delta.com/x"}) == 0.0  # http != https
    assert f(None, {"type": "url", "url": "delta.com/x"}) == 0.0
    g = m("is_expected_active_tab_approximate")
    assert g({"url": "https://a.com/p?q=1"}, {"type": "url", "url": "https://a.com/p?q=2"}) == 1.0
    assert g({"url": "https://a.com/p"}, {"type": "url", "url": "https://a.com/q"}) == 0.0
    h = m("is_expected_url_pattern_match")
    rules = {"expected": [r"dmv\.virginia\.gov", r"/licenses-&-ids/"]}
    assert h("https://www.dmv.virginia.gov/licenses-&-ids/renew", rules) == 1.0
    assert h({"url": "https://www.dmv.virginia.gov/vehicles"}, rules) == 0.0
    assert h(["not", "a url"], rules) == 0.0
    s = m("is_expected_search_query")
    assert (
        s(
            {"url": "https://www.google.com/search?q=drip+coffee"},
            {"expect": {"pattern": r"q=drip"}},
        )
        == 1.0
    )
    assert s({"url": "https://www.google.com/"}, {"expect": {"pattern": r"q=drip"}}) == 0.0


def test_tabs_extensions_bookmarks():
    f = m("is_expected_tabs")
    tabs = [
        {"title": "a", "url": "https://www.lonelyplanet.com/"},
        {"title": "b", "url": "https://airbnb.com"},
    ]
    assert (
        f(tabs, {"type": "url", "urls": ["https://airbnb.com.sg", "https://lonelyplanet.com"]})
        == 1.0
    )
    assert f(tabs, {"type": "url", "urls": ["https://airbnb.com"]}) == 0.0
    g = m("is_expected_installed_extensions")
    assert g(["Zoom for Google Chrome", "uBlock"], {"expected": ["Zoom Chrome Extension"]}) == 1.0
    assert g(["uBlock"], {"expected": ["Zoom Chrome Extension"]}) == 0.0
    b = m("is_expected_bookmarks")
    marks = {
        "bookmark_bar": {
            "children": [
                {
                    "type": "folder",
                    "name": "Liked Authors",
                    "children": [
                        {"type": "url", "url": "https://a.org/x"},
                        {"type": "url", "url": "https://b.org/y"},
                    ],
                },
                {"type": "url", "name": "News", "url": "https://news.org/"},
            ]
        }
    }
    assert b(marks, {"type": "bookmark_bar_folders_names", "names": ["Liked Authors"]}) == 1.0
    assert b(marks, {"type": "bookmark_bar_websites_urls", "urls": ["https://news.org/"]}) == 1.0
    liked = {
        "type": "liked_authors_websites_urls",
        "urls": [["https://a.org/x", "https://a.org/alt"], "https://b.org/y"],
    }
    assert b(marks, liked) == 1.0
    assert b(marks, {**liked, "urls": ["https://a.org/alt", "https://b.org/y"]}) == 0.0
    assert b(None, liked) == 0.0
    with pytest.raises(TypeError):
        b(marks, {"type": "nope"})


def test_cookies_history_shortcuts_fonts_cart():
    c = m("is_cookie_deleted")
    cookies = [(1, ".amazon.com", "session"), (2, "news.org", "id")]
    assert c(cookies, {"type": "domains", "domains": [".facebook.com"]}) == 1.0
    assert c(cookies, {"type": "domains", "domains": ["news.org"]}) == 0.0
    h = m("check_history_deleted")
    hist = [("https://www.amazon.com/cart", "Cart", 1)]
    assert h(hist, {"type": "keywords", "keywords": ["youtube"]}) == 1.0
    assert h(hist, {"type": "keywords", "keywords": ["amazon"]}) == 0.0
    s = m("is_shortcut_on_desktop")
    shortcuts = {
        "/home/user/Desktop/x.desktop": "[Desktop Entry]\nName=Amazon Shopping\nExec=google-chrome --app=https://amazon.com\n"
    }
    assert s(shortcuts, {"type": "name", "name": "amazon"}) == 1.0  # contained, any case
    assert s(shortcuts, {"type": "name", "name": "Netflix"}) == 0.0
    assert s(shortcuts, {"type": "exec", "exec": "google-chrome --app=https://amazon.com"}) == 1.0
    assert s({}, {"type": "exec", "exec": "x"}) == 0.0
    fs = m("check_font_size")
    assert fs({"default_font_size": 20}, {"type": "range", "min": 16, "max": 99999}) == 1.0
    assert fs({"default_font_size": 16}, {"type": "range", "min": 16, "max": 99999}) == 0.0
    assert fs({"default_font_size": 16}, {"type": "value", "value": 16}) == 1.0
    cart = m("is_added_to_steam_cart")
    page = {"content": "Your cart: Dota 2 Soundtrack, Portal 2"}
    assert cart(page, {"items": ["Portal 2"]}) == 1.0
    assert cart(page, {"items": ["Portal 2", "Half-Life"]}) == 0.0

"""Chrome, VLC, GIMP, Impress and window getters, and the Chrome setup steps (HostVM desktop).

The browser's DevTools endpoint and VLC's HTTP interface are small local HTTP servers speaking
the documented routes (``/json/list``, ``PUT /json/new?URL``, ``/json/close/ID``;
``/requests/status.xml`` with basic auth); programs the getters run in the desktop
(``xdg-mime``, ``xdotool``, ``xprop``, ``gsettings``) are stand-in scripts on the desktop's PATH.
"""

import asyncio
import base64
import http.server
import json
import shutil
import sqlite3
import threading
import time
import zipfile
from pathlib import Path

import pytest

from osworld_jax.env import cache, setup
from osworld_jax.env.evaluators import GETTERS
from osworld_jax.env.evaluators import getters_apps as apps
from osworld_jax.env.evaluators.getters_chrome import active_url_from_tree, macys_path_facts
from osworld_jax.env.evaluators.registry import EvalContext
from osworld_jax.env.setup import SetupStepError, run_setup
from osworld_jax.env.tasks import SetupStep
from tests.env.evaluators.hostvm import HostVM


def run(coro):
    return asyncio.run(coro)


def g(name):
    return GETTERS.get(name)


@pytest.fixture
def vm(tmp_path):
    return HostVM(tmp_path / "home")


@pytest.fixture
def ctx(tmp_path):
    (tmp_path / "work").mkdir()
    return EvalContext(work_dir=tmp_path / "work")


def put(vm, path, data):
    p = vm.local(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


PREFS = "~/.config/google-chrome/Default/Preferences"


def test_chrome_preference_getters(vm, ctx):
    prefs = {
        "default_search_provider_data": {"template_url_data": {"short_name": "Bing"}},
        "profile": {"name": "Thomas", "default_content_setting_values": {"cookies": 2}},
        "webkit": {"webprefs": {"default_font_size": 20}},
        "enable_do_not_track": True,
        "safebrowsing": {"enabled": True},
        "session": {"restore_on_startup": 5},
        "extensions": {
            "settings": {"abc": {"path": "/home/user/ext", "manifest": {"name": "Helper"}}}
        },
    }
    want = {
        "default_search_engine": "Bing",
        "profile_name": "Thomas",
        "chrome_font_size": {"default_font_size": 20},
        "enable_do_not_track": "true",
        "enable_safe_browsing": "true",
        "enable_enhanced_safety_browsing": "false",
        "new_startup_page": "true",
        "find_unpacked_extension_path": ["/home/user/ext"],
        "find_installed_extension_name": ["Helper"],
        "data_delete_automacally": "true",
    }
    # no profile yet: upstream's fallbacks (note its quirky "Google" for several)
    fallbacks = {
        "default_search_engine": "Google",
        "profile_name": None,
        "chrome_font_size": {"default_fixed_font_size": 13, "default_font_size": 16},
        "enable_do_not_track": "false",
        "enable_safe_browsing": "false",
        "enable_enhanced_safety_browsing": "Google",
        "new_startup_page": "Google",
        "find_unpacked_extension_path": "Google",
        "find_installed_extension_name": "Google",
        "data_delete_automacally": "Google",
    }
    for name, value in fallbacks.items():
        assert run(g(name)(vm, {}, ctx)) == value, name
    put(vm, PREFS, json.dumps(prefs))
    for name, value in want.items():
        assert run(g(name)(vm, {}, ctx)) == value, name
    put(vm, PREFS, json.dumps({"session": {"restore_on_startup": 1}, "profile": {}}))
    assert run(g("new_startup_page")(vm, {}, ctx)) == "false"
    assert run(g("data_delete_automacally")(vm, {}, ctx)) == "false"
    assert run(g("enable_do_not_track")(vm, {}, ctx)) == "false"
    put(
        vm,
        "~/.config/google-chrome/Local State",
        json.dumps({"browser": {"enabled_labs_experiments": ["a@1"]}}),
    )
    assert run(g("enabled_experiments")(vm, {}, ctx)) == ["a@1"]


def test_bookmarks_history_cookies_shortcuts(vm, ctx, tmp_path):
    assert run(g("bookmarks")(vm, {}, ctx)) == []
    roots = {"bookmark_bar": {"children": [{"type": "url", "name": "N", "url": "https://n.org/"}]}}
    put(vm, "~/.config/google-chrome/Default/Bookmarks", json.dumps({"roots": roots, "version": 1}))
    assert run(g("bookmarks")(vm, {}, ctx)) == roots

    def db(path, sql, rows):
        p = tmp_path / Path(path).name
        con = sqlite3.connect(p)
        con.executescript(sql)
        con.executemany(
            f"INSERT INTO {sql.split()[2]} VALUES ({','.join('?' * len(rows[0]))})", rows
        )
        con.commit()
        con.close()
        put(vm, path, p.read_bytes())

    assert run(g("history")(vm, {"dest": "h.sqlite"}, ctx)) is None
    db(
        "~/.config/google-chrome/Default/History",
        "CREATE TABLE urls (id INTEGER PRIMARY KEY, url TEXT, title TEXT,"
        " last_visit_time INTEGER);",
        [(1, "https://a.org/", "A", 5)],
    )
    assert run(g("history")(vm, {"dest": "h.sqlite"}, ctx)) == [("https://a.org/", "A", 5)]
    db(
        "~/.config/google-chrome/Default/Cookies",
        "CREATE TABLE cookies (creation_utc INTEGER, host_key TEXT, name TEXT);",
        [(1, ".amazon.com", "session")],
    )
    assert run(g("cookie_data")(vm, {"dest": "c.sqlite"}, ctx)) == [(1, ".amazon.com", "session")]
    assert run(g("shortcuts_on_desktop")(vm, {}, ctx)) == {}
    put(vm, "~/Desktop/amazon.desktop", "[Desktop Entry]\nName=Amazon\n")
    put(vm, "~/Desktop/notes.txt", "x")
    assert run(g("shortcuts_on_desktop")(vm, {}, ctx)) == {
        "amazon.desktop": "[Desktop Entry]\nName=Amazon\n"
    }


CHROME_TREE = (
    '<desktop-frame><application name="{app}"><frame>'
    '<entry name="Address and search bar">{url}</entry></frame></application></desktop-frame>'
)


def test_active_url_and_url_parsers(vm, ctx, monkeypatch):
    query = "fromStation=BOM&amp;toStation=STO,ARN&amp;departing=2024-03-11"  # XML-escaped "&"
    tree = CHROME_TREE.format(app="Google Chrome", url=f"www.delta.com/flight-search?{query}")
    assert (
        active_url_from_tree(tree)
        == "https://www.delta.com/flight-search?fromStation=BOM&toStation=STO,ARN&departing=2024-03-11"
    )
    assert (
        active_url_from_tree(CHROME_TREE.format(app="Chromium", url="a.org"), "http://")
        == "http://a.org"
    )
    assert active_url_from_tree(CHROME_TREE.format(app="Firefox", url="a.org")) is None
    assert active_url_from_tree(CHROME_TREE.format(app="Chromium", url="")) is None

    async def a11y():
        return tree

    monkeypatch.setattr(vm, "accessibility", a11y)
    assert run(g("active_url_from_accessTree")(vm, {"goto_prefix": "https://"}, ctx)).startswith(
        "https://www.delta"
    )
    parsed = run(
        g("active_tab_url_parse")(
            vm,
            {
                "parse_keys": ["fromStation", "toStation", "departing"],
                "replace": {"departing": "time"},
            },
            ctx,
        )
    )
    assert parsed == {"fromStation": "BOM", "toStation": "STO,ARN", "time": "2024-03-11"}
    split = run(
        g("active_tab_url_parse")(vm, {"parse_keys": ["toStation"], "split_list": True}, ctx)
    )
    assert split == {"toStation": ["STO", "ARN"]}
    dash = {"partIndex": 3, "needDeleteId": True, "returnType": "json", "key": "page"}
    assert run(g("url_dashPart")(vm, dash, ctx)) == {"page": "flight-search"}
    assert run(g("url_dashPart")(vm, {**dash, "partIndex": 9}, ctx)) is None
    url = "https://www.macys.com/shop/mens-clothing/mens-shirts/Product_department,Sleeve_length/Shirts,Short%20Sleeve"
    facts = macys_path_facts(url, ["Product_department", "Price_discount_range"])
    assert (
        facts["mens_clothing"] is True and facts["shirts"] is True and facts["short_sleeve"] is True
    )
    assert (
        facts["Product_department"] == "Shirts"
        and facts["Price_discount_range"] == "not_50_PERCENT_ off & more"
    )
    assert "url_path_parse" in GETTERS and "macys_product_url_parse" in GETTERS


class _Server:
    """A threaded local HTTP server with a handler function (the desktop's services)."""

    def __init__(self, handle):
        outer = self
        self.requests = []

        class H(http.server.BaseHTTPRequestHandler):
            def _do(self):
                outer.requests.append((self.command, self.path, self.headers.get("Authorization")))
                code, body = handle(self.command, self.path, self.headers)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = _do

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = str(self.httpd.server_address[1])
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeDevTools:
    """Chrome's DevTools HTTP routes over a list of page targets."""

    def __init__(self):
        self.pages = [
            {"id": "T0", "type": "page", "title": "New Tab", "url": "chrome://newtab/"},
            {"id": "W", "type": "service_worker", "title": "", "url": "chrome-extension://x"},
        ]
        self.next = 1

    def __call__(self, method, path, headers):
        if path == "/json/list":
            return 200, self.pages
        if path.startswith("/json/new?") and method == "PUT":
            t = {
                "id": f"T{self.next}",
                "type": "page",
                "title": "",
                "url": path[len("/json/new?") :],
            }
            self.next += 1
            self.pages.append(t)
            return 200, t
        if path.startswith("/json/close/"):
            tid = path.rsplit("/", 1)[1]
            self.pages = [p for p in self.pages if p["id"] != tid]
            return 200, b"Target is closing"
        return 404, b"no"


@pytest.fixture
def devtools(monkeypatch):
    fake = FakeDevTools()
    server = _Server(fake)
    monkeypatch.setattr(setup, "DEVTOOLS_PORTS", ("1", server.port))  # port 1: nothing listens
    yield fake, server
    server.close()


def test_chrome_tabs_steps_and_open_tabs_info(vm, ctx, devtools):
    fake, _ = devtools
    assert run(g("open_tabs_info")(vm, {}, ctx)) == [
        {"title": "New Tab", "url": "chrome://newtab/"}
    ]
    urls = ["https://www.lonelyplanet.com/", "https://airbnb.com/"]
    run(run_setup([SetupStep(type="chrome_open_tabs", parameters={"urls_to_open": urls})], vm))
    assert [p["url"] for p in fake.pages if p["type"] == "page"] == urls  # the start tab closed
    step = SetupStep(
        type="chrome_close_tabs", parameters={"urls_to_close": ["https://lonelyplanet.com"]}
    )
    run(run_setup([step], vm))
    assert run(g("open_tabs_info")(vm, {}, ctx)) == [{"title": "", "url": "https://airbnb.com/"}]


def test_chrome_steps_without_chrome_fail_and_getter_gives_empty(vm, ctx, monkeypatch):
    monkeypatch.setattr(setup, "DEVTOOLS_PORTS", ("1",))
    monkeypatch.setattr(setup, "DEVTOOLS_WAIT_S", 1.0)
    assert run(g("open_tabs_info")(vm, {}, ctx)) == []
    t0 = time.monotonic()
    with pytest.raises(SetupStepError, match="no DevTools endpoint"):
        run(
            run_setup(
                [SetupStep(type="chrome_open_tabs", parameters={"urls_to_open": ["file:///x"]})], vm
            )
        )
    assert time.monotonic() - t0 >= 1.0  # it waited for Chrome to come up before giving up


def test_update_browse_history(vm, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    template = cache_dir / cache.cache_keys(cache.HISTORY_EMPTY_URL)[0]
    con = sqlite3.connect(template)
    con.executescript(
        "CREATE TABLE urls (id INTEGER PRIMARY KEY, url TEXT, title TEXT, visit_count INTEGER,"
        " typed_count INTEGER, last_visit_time INTEGER, hidden INTEGER);"
        "CREATE TABLE visits (id INTEGER PRIMARY KEY, url INTEGER, visit_time INTEGER,"
        " from_visit INTEGER, transition INTEGER, segment_id INTEGER, visit_duration INTEGER);"
    )
    con.close()
    step = SetupStep(
        type="update_browse_history",
        parameters={
            "history": [
                {
                    "url": "https://www.youtube.com/watch?v=x",
                    "title": "Video",
                    "visit_time_from_now_in_seconds": 3600,
                }
            ]
        },
    )
    run(run_setup([step], vm, cache_dir=cache_dir))
    got = vm.local("~/.config/google-chrome/Default/History")
    con = sqlite3.connect(got)
    ((url, title, stamp),) = con.execute("SELECT url, title, last_visit_time FROM urls").fetchall()
    ((visit_url, transition),) = con.execute("SELECT url, transition FROM visits").fetchall()
    con.close()
    assert (url, title, visit_url, transition) == (
        "https://www.youtube.com/watch?v=x",
        "Video",
        1,
        805306368,
    )
    import datetime as dt

    # an hour ago, in microseconds since 1601-01-01 (a few seconds of slack for the test itself)
    expect = int(
        ((dt.datetime.now() - dt.timedelta(hours=1)) - dt.datetime(1601, 1, 1)).total_seconds()
        * 1e6
    )
    assert abs(stamp - expect) < 60e6
    template.unlink()
    with pytest.raises(SetupStepError, match="not in the local file cache"):
        run(run_setup([step], vm, cache_dir=cache_dir))


def test_vlc_status_and_config(vm, ctx, monkeypatch):
    status = b"<root><state>playing</state></root>"

    def handle(method, path, headers):
        ok = headers.get("Authorization") == "Basic " + base64.b64encode(b":password").decode()
        return (200, status) if ok and path == "/requests/status.xml" else (401, b"no")

    server = _Server(handle)
    try:
        monkeypatch.setattr(apps, "VLC_HTTP_PORT", server.port)
        p = run(g("vlc_playing_info")(vm, {"dest": "status.xml"}, ctx))
        assert open(p, "rb").read() == status
        monkeypatch.setattr(apps, "VLC_HTTP_PORT", "1")
        assert run(g("vlc_playing_info")(vm, {"dest": "status.xml"}, ctx)) is None
    finally:
        server.close()
    with pytest.raises(FileNotFoundError):
        run(g("vlc_config")(vm, {"dest": "vlcrc"}, ctx))
    put(vm, "~/.config/vlc/vlcrc", "qt-bgcone=0\n")
    assert open(run(g("vlc_config")(vm, {"dest": "vlcrc"}, ctx))).read() == "qt-bgcone=0\n"
    assert run(g("gimp_config_file")(vm, {"file_name": "gimprc", "dest": "gimprc"}, ctx)) is None
    put(vm, "~/.config/GIMP/2.10/gimprc", "(undo-levels 100)\n")
    assert (
        open(run(g("gimp_config_file")(vm, {"file_name": "gimprc", "dest": "g"}, ctx))).read()
        == "(undo-levels 100)\n"
    )


def _fake_bin(tmp_path, monkeypatch, name, script):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    p = bindir / name
    p.write_text("#!/bin/sh\n" + script)
    p.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{shutil.os.environ['PATH']}")


def test_programs_in_the_desktop(vm, ctx, tmp_path, monkeypatch):
    # default video player: the most common xdg-mime answer over the video types
    _fake_bin(
        tmp_path,
        monkeypatch,
        "xdg-mime",
        'case "$3" in video/x-*) echo vlc.desktop;; *) echo totem.desktop;; esac\n',
    )
    # 45 of the 85 listed types are video/x-*: VLC wins
    assert run(g("default_video_player")(vm, {}, ctx)) == "vlc.desktop\n"
    # window size through xdotool + xprop
    _fake_bin(
        tmp_path,
        monkeypatch,
        "xdotool",
        'if [ "$1" = search ]; then echo 11; echo 22; '
        "else echo WINDOW=$3; echo WIDTH=1920; echo HEIGHT=1080; fi\n",
    )
    _fake_bin(
        tmp_path,
        monkeypatch,
        "xprop",
        'if [ "$2" = 22 ]; then echo \'WM_CLASS(STRING) = "vlc", "Vlc"\'; '
        'else echo \'WM_CLASS(STRING) = "vlc-helper", "Other"\'; fi\n',
    )
    assert run(g("vm_window_size")(vm, {"app_class_name": "VLC"}, ctx)) == {
        "width": 1920,
        "height": 1080,
    }
    assert run(g("vm_window_size")(vm, {"app_class_name": "gimp"}, ctx)) is None
    # wallpaper: gsettings' picture-uri, the file copied (empty when unset)
    put(vm, "~/Pictures/bg.png", b"PNG")
    _fake_bin(tmp_path, monkeypatch, "gsettings", f"echo \"'file://{vm.home}/Pictures/bg.png'\"\n")
    assert open(run(g("vm_wallpaper")(vm, {"dest": "bg.png"}, ctx)), "rb").read() == b"PNG"
    _fake_bin(tmp_path, monkeypatch, "gsettings", "exit 1\n")
    assert open(run(g("vm_wallpaper")(vm, {"dest": "bg2.png"}, ctx)), "rb").read() == b""


REL = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"


def _deck_with_media(src, vm, path, audio=True, background=True):
    from pptx import Presentation

    prs = Presentation()
    prs.slides.add_slide(prs.slide_layouts[6])
    plain = src.path("plain.pptx")
    prs.save(plain)
    out = src.path("media.pptx")
    rels = ""
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "ppt/slides/_rels/slide1.xml.rels":
                extra = ""
                if audio:
                    extra += (
                        f'<Relationship Id="rIdA" Type="{REL}/audio" Target="../media/sound1.mp3"/>'
                    )
                if background:
                    extra += (
                        f'<Relationship Id="rIdB" Type="{REL}/image" Target="../media/bg1.png"/>'
                    )
                data = data.replace(b"</Relationships>", extra.encode() + b"</Relationships>")
                rels = data
            if item.filename == "ppt/slides/slide1.xml" and background:
                bg = (
                    '<p:bg><p:bgPr><a:blipFill><a:blip r:embed="rIdB"/></a:blipFill>'
                    "<a:effectLst/></p:bgPr></p:bg>"
                )
                data = data.replace(b"<p:cSld>", b"<p:cSld>" + bg.encode())
            zout.writestr(item, data)
        zout.writestr("ppt/media/sound1.mp3", b"ID3 audio")
        zout.writestr("ppt/media/bg1.png", b"PNG bg")
    put(vm, path, out.read_bytes())
    return rels


def test_slide_media(vm, ctx, src):
    deck = "/home/user/Desktop/deck.pptx"
    _deck_with_media(src, vm, deck)
    params = {"ppt_file_path": deck, "slide_index": 0, "dest": "x"}
    assert open(run(g("audio_in_slide")(vm, params, ctx)), "rb").read() == b"ID3 audio"
    assert open(run(g("background_image_in_slide")(vm, params, ctx)), "rb").read() == b"PNG bg"
    _deck_with_media(src, vm, deck, audio=False, background=False)
    assert run(g("audio_in_slide")(vm, params, ctx)) is None
    assert run(g("background_image_in_slide")(vm, params, ctx)) is None
    assert run(g("background_image_in_slide")(vm, {**params, "slide_index": 4}, ctx)) is None

"""The desktop applications in the jail, started the way the OSWorld tasks start them, and the
getters and metrics of their tasks on the state the real applications leave.

One shared jailed desktop (the session's ``real_apps``: LibreOffice and GIMP already serve the
evaluator tests' ``apps`` fixture source there). Chromium is started as the Chrome tasks start it
(``google-chrome --remote-debugging-port=1337`` + ``socat`` forwarding 9222), with tabs opened
by ``chrome_open_tabs`` and a bookmark made with Ctrl+D; VLC as the VLC tasks start it, read
through its HTTP interface; Thunderbird on a profile it writes itself; GIMP's own config files.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from osworld_jax.env.evaluators import GETTERS, METRICS, getters_apps
from osworld_jax.env.evaluators.registry import EvalContext
from osworld_jax.env.local import apps
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tasks import SetupStep

pytestmark = pytest.mark.slow


def step(kind: str, **params) -> SetupStep:
    return SetupStep(type=kind, parameters=params)


def getter(ra, ctx, name: str, **params):
    return ra.run(GETTERS.get(name)(ra.desktop.client, params, ctx))


def until(fn, what: str, timeout: float = 60.0):
    """Polls ``fn()`` until it returns something truthy (apps start slower under load)."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what} not within {timeout:g} s (last: {value!r})")
        time.sleep(0.5)


@pytest.fixture
def ctx(tmp_path):
    (tmp_path / "work").mkdir()
    return EvalContext(work_dir=tmp_path / "work")


def test_every_app_is_installed_and_on_the_jails_path(real_apps):
    for app in apps.APPS:
        assert apps.installed(app), app.name
        for command in app.commands:
            assert apps.has_app(command), command
        res = real_apps.execute(list(app.probe))
        assert res["returncode"] == 0, (app.name, res)
    assert getters_apps.VLC_HTTP_PORT == str(apps.VLC_HTTP_PORT)


def test_chrome_tabs_bookmarks_history_and_preferences(real_apps, ctx, tmp_path):
    ra, m = real_apps, METRICS.get
    pages = {}
    for name in ("alpha", "beta"):
        path = f"/home/user/pages/{name}.html"
        ra.upload(path, f"<html><head><title>{name.title()}</title></head><body>{name}</body>")
        pages[name] = f"file://{path}"

    # a bookmark-bar folder the task's profile has (Chromium reads this file and writes it back)
    def folder(i, name, children=()):
        return {
            "id": str(i),
            "guid": str(uuid.uuid4()),
            "name": name,
            "type": "folder",
            "date_added": "13300000000000000",
            "date_modified": "0",
            "children": list(children),
        }

    roots = {
        "bookmark_bar": folder(1, "Bookmarks bar", [folder(4, "Work")]),
        "other": folder(2, "Other bookmarks"),
        "synced": folder(3, "Mobile bookmarks"),
    }
    ra.upload(
        apps_profile("Default/Bookmarks"), json.dumps({"roots": roots, "version": 1}).encode()
    )
    setup = [
        step("launch", command=["google-chrome", "--remote-debugging-port=1337"]),
        step("launch", command=["socat", "tcp-listen:9222,fork", "tcp:localhost:1337"]),
        step("chrome_open_tabs", urls_to_open=[pages["alpha"], pages["beta"]]),
        step("activate_window", window_name="Google Chrome"),
    ]
    vm = ra.desktop.client
    try:
        ra.run(run_setup(setup, vm, ctx=SetupContext(work_dir=tmp_path)))
        ra.run(vm.activate_window("Google Chrome"))  # Chromium's window answers to that name
        # A tab still loading shows its file name as its title ("beta.html"): wait for both
        # pages' <title>s (under a 2-core load the second tab can lag the first by seconds).
        tabs = until(
            lambda: (
                (t := getter(ra, ctx, "open_tabs_info"))
                and sorted(x["title"] for x in t) == ["Alpha", "Beta"]
                and t
            ),
            "the tabs loaded",
        )
        # (DevTools lists the most recently used tab first; the metrics ignore the order)
        assert sorted(tabs, key=lambda t: t["title"]) == [
            {"title": "Alpha", "url": pages["alpha"]},
            {"title": "Beta", "url": pages["beta"]},
        ]
        rule = {"type": "url", "urls": [pages["alpha"], pages["beta"]]}
        assert m("is_expected_tabs")(tabs, rule) == 1.0
        assert m("is_expected_tabs")(tabs, {**rule, "urls": [pages["beta"]]}) == 0.0
        ra.run(run_setup([step("chrome_close_tabs", urls_to_close=[pages["alpha"]])], vm))
        tabs = getter(ra, ctx, "open_tabs_info")
        assert [t["url"] for t in tabs] == [pages["beta"]]
        # the address bar, read from the accessibility tree (Chromium shows a file URL as its
        # path; the getter puts goto_prefix, "https://" by default, in front of what it shows)
        url = until(
            lambda: getter(ra, ctx, "active_url_from_accessTree", goto_prefix="file://"),
            "address bar",
        )
        assert m("is_expected_active_tab")(url, {"type": "url", "url": pages["beta"]}) == 1.0
        # a bookmark made as a user makes it: Ctrl+D, Enter (Chromium files it under "Other
        # bookmarks" and writes the whole file, the task's bar folder included)
        ra.shell("xdotool key ctrl+d && sleep 1 && xdotool key Return")
        books = until(
            lambda: (
                (b := getter(ra, ctx, "bookmarks")) and b.get("other", {}).get("children") and b
            ),
            "the bookmark",
        )
        assert [x["url"] for x in books["other"]["children"]] == [pages["beta"]]
        folders = {"type": "bookmark_bar_folders_names", "names": ["Work"]}
        assert m("is_expected_bookmarks")(books, folders) == 1.0
        assert m("is_expected_bookmarks")(books, {**folders, "names": ["Home"]}) == 0.0
        on_bar = {"type": "bookmark_bar_websites_urls", "urls": [pages["beta"]]}
        assert m("is_expected_bookmarks")(books, on_bar) == 0.0  # not on the bar
        # Chromium commits its History database every 10 s (and a task's episode is longer)
        history = until(
            lambda: (
                {r[0] for r in getter(ra, ctx, "history", dest="H.sqlite") or []}
                >= {pages["alpha"], pages["beta"]}
            ),
            "the visits in History",
        )
    finally:
        ra.launch(["pkill", "chrome"])  # the Chrome tasks' postconfig: Chrome writes its files
    # Chromium is gone when its DevTools port no longer answers
    probe = "import socket; socket.create_connection(('127.0.0.1', 1337), 2)"
    until(lambda: ra.execute(["python3", "-c", probe])["returncode"] != 0, "Chromium to quit")
    history = getter(ra, ctx, "history", dest="History.sqlite")
    visited = {row[0] for row in history}
    assert {pages["alpha"], pages["beta"]} <= visited
    assert m("check_history_deleted")(history, {"type": "keywords", "keywords": ["alpha"]}) == 0.0
    assert m("check_history_deleted")(history, {"type": "keywords", "keywords": ["gamma"]}) == 1.0
    cookies = getter(ra, ctx, "cookie_data", dest="Cookies.sqlite")
    assert cookies == []  # the real Cookies database: local pages set none
    assert m("is_cookie_deleted")(cookies, {"type": "domains", "domains": [".example.org"]}) == 1.0
    prefs = json.loads(ra.file(apps_profile("Default/Preferences")))
    assert getter(ra, ctx, "profile_name") == prefs["profile"]["name"]
    assert getter(ra, ctx, "enable_do_not_track") == "false"  # Chromium's default
    search = getter(ra, ctx, "default_search_engine")
    assert search == prefs.get("default_search_provider_data", {}).get("template_url_data", {}).get(
        "short_name", "Google"
    )


def apps_profile(rel: str) -> str:
    return f"/home/user/.config/google-chrome/{rel}"


def _clip() -> bytes:
    """A 3-second 64x48 MJPEG AVI made with OpenCV (moving bar)."""
    import tempfile

    import cv2
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "clip.avi")
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
        for i in range(30):
            frame = np.full((48, 64, 3), 40, np.uint8)
            frame[:, (2 * i) % 64 : (2 * i) % 64 + 6] = (0, 200, 255)
            out.write(frame)
        out.release()
        return Path(path).read_bytes()


def test_vlc_status_over_its_http_interface_and_its_config(real_apps, ctx):
    ra, m = real_apps, METRICS.get
    ra.upload("/home/user/Desktop/clip.avi", _clip())
    cmd = "VLC_VERBOSE=-1 vlc --no-audio --no-video-title-show --loop /home/user/Desktop/clip.avi"
    vm = ra.desktop.client
    try:
        ra.run(run_setup([step("launch", command=cmd, shell=True)], vm))
        status = until(
            lambda: (
                (p := getter(ra, ctx, "vlc_playing_info", dest="status.xml"))
                and b"<state>playing</state>" in Path(p).read_bytes()
                and p
            ),
            "VLC playing",
        )
        playing = {"type": "file_name", "file_name": "clip.avi"}
        assert m("is_vlc_playing")(status, playing) == 1.0
        assert m("is_vlc_playing")(status, {**playing, "file_name": "other.avi"}) == 0.0
        ra.run(vm.activate_window("VLC media player"))
        ra.shell("xdotool key space")  # pause, as a user does
        paused = until(
            lambda: (
                (p := getter(ra, ctx, "vlc_playing_info", dest="status2.xml"))
                and b"<state>paused</state>" in Path(p).read_bytes()
                and p
            ),
            "VLC paused",
        )
        assert m("is_vlc_playing")(paused, playing) == 0.0
    finally:
        ra.launch(["pkill", "vlc"])  # the VLC tasks' postconfig
    # VLC writes its configuration file itself when a setting changed (here through its Lua
    # interface instead of the preferences dialog)
    ra.upload(
        "/home/user/.local/share/vlc/lua/intf/osworld_set.lua",
        b'vlc.config.set("qt-bgcone", false)\nvlc.config.set("qt-max-volume", 200)\n'
        b"vlc.misc.quit()\n",
    )
    ra.shell("timeout 60 /usr/bin/vlc -I luaintf --lua-intf=osworld_set >/dev/null 2>&1")
    vlcrc = getter(ra, ctx, "vlc_config", dest="vlcrc")
    assert "qt-bgcone=0" in Path(vlcrc).read_text().splitlines()
    assert m("check_qt_bgcone")(vlcrc, {"expected_qt_bgcone": 0}) == 1.0
    assert m("check_qt_bgcone")(vlcrc, {"expected_qt_bgcone": 1}) == 0.0
    assert m("check_qt_max_volume")(vlcrc, {"expected_qt_max_volume": 200}) == 1.0
    assert m("check_qt_max_volume")(vlcrc, {"expected_qt_max_volume": 125}) == 0.0


def test_thunderbird_writes_the_profile_its_metrics_read(real_apps, ctx):
    ra, m = real_apps, METRICS.get
    profile = "/home/user/.thunderbird/t5q2a5hp.default-release"
    # a preference set in the profile's user.js: Thunderbird writes it into prefs.js
    ra.upload(f"{profile}/user.js", b'user_pref("mail.spellcheck.inline", false);\n')
    ra.launch(["/usr/bin/thunderbird", "--headless", "--profile", profile])
    until(lambda: ra.execute(["test", "-s", f"{profile}/prefs.js"])["returncode"] == 0, "prefs.js")
    ra.launch(["pkill", "thunderbird"])
    until(
        lambda: b"mail.spellcheck.inline" in ra.file(f"{profile}/prefs.js"),
        "Thunderbird to write its preferences",
    )
    local = Path(ctx.work_dir) / "prefs.js"
    local.write_bytes(ra.file(f"{profile}/prefs.js"))
    spell = {"expect": {"mail.spellcheck.inline": {"method": "eq", "ref": False}}}
    assert m("check_thunderbird_prefs")(str(local), spell) == 1.0
    assert m("check_thunderbird_prefs")(str(local), {"unexpect": spell["expect"]}) == 0.0


def test_gimp_writes_the_config_files_its_metric_reads(real_apps, ctx):
    ra, m = real_apps, METRICS.get
    ra.upload("/home/user/.config/GIMP/2.10/gimprc", b"(undo-levels 100)\n")
    ra.launch(["gimp"])  # as the GIMP tasks launch it
    until(lambda: "GNU Image" in ra.shell("wmctrl -l"), "GIMP's window", 120)
    time.sleep(3)  # (the window shows before GIMP takes keys)
    ra.run(ra.desktop.client.activate_window("GNU Image Manipulation Program"))
    # Tab hides the docks (task d52d6308), Ctrl+Q quits: GIMP writes sessionrc and gimprc
    ra.shell("xdotool key Tab && sleep 1 && xdotool key ctrl+q")
    until(
        lambda: b"hide-docks" in ra.file("/home/user/.config/GIMP/2.10/sessionrc"),
        "GIMP to write its sessionrc",
    )
    session = getter(ra, ctx, "gimp_config_file", file_name="sessionrc", dest="sessionrc")
    assert m("check_config_status")(session, {"key": "hide-docks", "value": "yes"}) == 1.0
    assert m("check_config_status")(session, {"key": "hide-docks", "value": "no"}) == 0.0
    gimprc = getter(ra, ctx, "gimp_config_file", file_name="gimprc", dest="gimprc")
    assert "# GIMP gimprc" in Path(gimprc).read_text()  # written by GIMP itself
    assert m("check_config_status")(gimprc, {"key": "undo-levels", "value": "100"}) == 1.0
    assert m("check_config_status")(gimprc, {"key": "undo-levels", "value": "5"}) == 0.0


def test_preflight_starts_each_app_the_tasks_need_in_the_jail(real_apps):
    from osworld_jax.env.bundled import bundled_app_task_dir
    from osworld_jax.env.local import LocalBackend
    from osworld_jax.env.tasks import load_tasks

    backend = LocalBackend()
    try:
        backend.preflight(load_tasks(bundled_app_task_dir()))  # probes each app: no error
        assert backend.inventory() == []
    finally:
        real_apps.run(backend.aclose())


def test_the_session_bus_starts_no_app_service_for_the_agent(real_apps):
    """Attack: the agent asks the session bus to start GNOME Terminal's server. The bus runs
    services outside the agent's namespace, so that server's shells would live beside the
    evaluator's commands; the bus only knows the allow-listed services (apps.DBUS_SERVICES).
    """  # noqa: D205
    ra = real_apps
    start = [
        "dbus-send",
        "--session",
        "--print-reply",
        "--dest=org.freedesktop.DBus",
        "/org/freedesktop/DBus",
        "org.freedesktop.DBus.StartServiceByName",
        "string:org.gnome.Terminal",
        "uint32:0",
    ]
    res = ra.run(ra.desktop.run_action(start, timeout=30))
    assert res["returncode"] != 0
    assert "org.gnome.Terminal" in res["error"] and "service" in res["error"].lower()
    # GNOME Terminal itself works: its server starts in the agent's own namespace
    ra.run(ra.desktop.run_action(["gnome-terminal"], timeout=30))
    until(lambda: "Terminal" in ra.shell("wmctrl -l"), "the terminal window")
    ps = ra.run(ra.desktop.run_action(["ps", "-eo", "comm"], timeout=30))
    assert "gnome-terminal-" in ps["output"]  # (comm is cut at 15 characters)
    ra.launch(["pkill", "-f", "gnome-terminal-server"])

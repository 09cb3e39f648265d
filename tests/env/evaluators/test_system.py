"""Desktop, Thunderbird and accessibility-tree metrics (upstream ``basic_os.py``,
``thunderbird.py``, ``check_accessibility_tree``)."""

import pytest

from osworld_jax.env.evaluators import METRICS


def m(name):
    return METRICS.get(name)


def test_gnome_timezone_clipboard_moves():
    f = m("check_gnome_favorite_apps")
    printed = "['thunderbird.desktop', 'vim.desktop', 'google-chrome.desktop']\n"
    assert (
        f(printed, {"expected": ["vim.desktop", "google-chrome.desktop", "thunderbird.desktop"]})
        == 1.0
    )
    assert f(printed, {"expected": ["vim.desktop"]}) == 0.0
    assert f("__import__('os').system('true')", {"expected": []}) == 0.0  # never evaluated
    tz = m("is_utc_0")
    out = (
        "               Local time: Thu 2024-01-25 12:56:06 UTC\n"
        "           Universal time: Thu 2024-01-25 12:56:06 UTC\n"
        "                 RTC time: Thu 2024-01-25 12:56:05\n"
        "                Time zone: Etc/UTC (UTC, +0000)\n"
    )
    assert tz(out) == 1.0
    assert tz(out.replace("Etc/UTC (UTC, +0000)", "Europe/Paris (CET, +0100)")) == 0.0
    clip = m("is_in_vm_clickboard")
    assert clip({"expected": ["alpha", "beta"]}, "alpha beta\n") == 1.0
    assert clip({"expected": "gamma"}, "alpha beta\n") == 0.0
    mv = m("check_moved_jpgs")
    tree = {"type": "directory", "name": "cpjpg", "children": [{"type": "file", "name": "a.jpg"}]}
    assert mv(tree, {"expected": ["a.jpg"]}) == 1.0
    assert mv(tree, {"expected": ["a.jpg", "b.jpg"]}) == 0.0


PREFS = """\
// Mozilla User Preferences
user_pref("mail.identity.id1.fullName", "Anonym");
user_pref("mail.spam.manualMark", true);
user_pref("mailnews.default_sort_order", 2);
"""


def test_thunderbird_prefs(src):
    f = m("check_thunderbird_prefs")
    p = src.text("prefs.js", PREFS)
    assert f(p, {"expect": {"mail.spam.manualMark": {"method": "eq", "ref": True}}}) == 1.0
    assert f(p, {"expect": {"mailnews.default_sort_order": {"method": "eq", "ref": 1}}}) == 0.0
    assert f(p, {"expect": {"missing.key": {"method": "eq", "ref": 1}}}) == 0.0
    assert (
        f(p, {"unexpect": {"mail.identity.id1.fullName": {"method": "re", "ref": "Anon"}}}) == 0.0
    )
    assert f(None, {}) == 0.0


FILTERS = """\
version="9"
logging="no"
name="Move boss mail"
enabled="yes"
type="17"
action="Move to folder"
actionValue="mailbox://nobody@Local%20Folders/Boss"
condition="AND (from,contains,boss@corp.com)"
name="Tag \\"urgent\\""
enabled="no"
type="17"
action="AddTag"
actionValue="$label1"
condition="OR (subject,contains,urgent) OR (subject,contains,asap)"
"""


def test_thunderbird_filter(src):
    f = m("check_thunderbird_filter")
    p = src.text("msgFilterRules.dat", FILTERS)
    boss = {
        "name": "Move boss mail",
        "enabled": "yes",
        "action": "Move to folder",
        "condition": ["AND (from,contains,boss@corp.com)"],
    }
    assert f(p, {"expect": [boss]}) == 1.0
    assert f(p, {"expect": [{**boss, "enabled": "no"}]}) == 0.0
    urgent = {
        "name": 'Tag "urgent"',
        "condition": ["OR (subject,contains,urgent)", "OR (subject,contains,asap)"],
    }
    assert f(p, {"expect": [urgent]}) == 1.0
    assert f(p, {"expect": [boss], "unexpect": [{"action": "AddTag"}]}) == 0.0


def test_thunderbird_folder_keeps_upstreams_comparison(src):
    # Upstream's filter keeps only the blank pieces between "FROM - " separators, so two
    # folders compare equal when they have the same (de-duplicated) blank pieces: any two files
    # that start with "FROM - " are equal, a file without the separator differs from them.
    # We reproduce the score, not the intent (docs/EVALUATORS.md).
    f = m("check_thunderbird_folder")
    a = src.text("a", "FROM - x\nSubject: hi\n\nbody\nFROM - y\nSubject: yo\n")
    b = src.text("b", "FROM - z\nSubject: other\n")
    assert f(a, b) == 1.0
    assert f([a], [b]) == 1.0
    assert f(None, b) == 0.0
    assert f(src.text("nombox", "Subject: hi\n"), b) == 0.0  # no blank piece vs one


TREE = """\
<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state">
  <application name="gnome-terminal-server">
    <terminal name="Terminal" st:focused="true">user@host:~$ ls</terminal>
  </application>
</desktop-frame>"""


def test_check_accessibility_tree():
    f = m("check_accessibility_tree")
    assert f(TREE, [{"selectors": ["application[name=gnome-terminal-server] terminal"]}]) == 1.0
    assert (
        f(
            TREE,
            [{"xpath": "//terminal[@st:focused='true']", "text": "user@host:~$ ls", "exact": True}],
        )
        == 1.0
    )
    assert f(TREE, [{"xpath": "//terminal", "text": "user@host:~$ pwd", "exact": True}]) == 0.0
    # fuzzy: indel ratio of "user@host:~$ ls" and "user@host:~$ l" = 28/29
    assert f(
        TREE, [{"xpath": "//terminal", "text": "user@host:~$ l", "exact": False}]
    ) == pytest.approx(28 / 29)
    assert f(TREE, [{"selectors": ["button"]}]) == 0.0
    with pytest.raises(ValueError):
        f(TREE, [{"text": "x"}])

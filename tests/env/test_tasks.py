import hashlib
import json
from pathlib import Path

import pytest

from osworld_jax.env import tasks as T
from osworld_jax.env.capabilities import (
    APP,
    BACKEND,
    GDRIVE,
    GETTER,
    LIVE_WEB,
    LOGIN,
    METRIC,
    REMOTE_FILE,
    ROOT,
    SETUP,
    NotRunnable,
    Reason,
    Runnable,
    capabilities,
    runnable_tasks,
    unknown_types,
)
from osworld_jax.env.capabilities import main as report_main
from osworld_jax.env.local import LocalBackend
from osworld_jax.env.tasks import TaskFormatError, load_task, load_tasks


def _base(**over):
    d = {
        "id": "t1",
        "snapshot": "os",
        "instruction": "do it",
        "source": "",
        "config": [{"type": "execute", "parameters": {"command": ["true"]}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": "echo hi"},
            "expected": {"type": "rule", "rules": {"expected": "hi\n"}},
        },
    }
    d.update(over)
    return d


def test_all_369_load(osworld_examples):
    tasks = load_tasks(osworld_examples)
    assert len(tasks) == 369
    assert len({t.id for t in tasks}) == 369
    by_domain = {}
    for t in tasks:
        by_domain[t.domain] = by_domain.get(t.domain, 0) + 1
        # normalised parallel evaluator tuples
        n = len(t.evaluator.func)
        assert len(t.evaluator.result) == len(t.evaluator.expected) == len(t.evaluator.options) == n
    assert by_domain["os"] == 24 and by_domain["multi_apps"] == 101
    # unknown types are recorded, not crashes: the upstream set uses types we do not implement
    unknown = {u for t in tasks for u in unknown_types(t)}
    assert "getter:googledrive_file" in unknown  # needs Google Drive: never offline
    assert "setup:googledrive" in unknown
    assert not any(u.startswith("metric:exact_match") for u in unknown)


def test_single_and_list_func_normalisation(osworld_examples):
    # os/3ce045a0: two check_include_exclude metrics on two vm_command_line getters
    t = load_task(osworld_examples / "os" / "3ce045a0-877b-42aa-8d2c-b4a863336ab8.json")
    assert t.evaluator.func == ("check_include_exclude", "check_include_exclude")
    assert [g.type for g in t.evaluator.result] == ["vm_command_line"] * 2
    assert t.evaluator.conj == "or"  # as written in the file
    t2 = load_task(osworld_examples / "os" / "a462a795-fdc7-4b23-b689-e8b6df786b78.json")
    assert t2.evaluator.is_infeasible and t2.evaluator.result == (None,)


def test_report_runs(osworld_examples, capsys):
    assert report_main(["report", str(osworld_examples), "--backend", "local"]) == 0
    out = capsys.readouterr().out
    assert "tasks=369" in out
    for domain in ("chrome", "gimp", "os", "vs_code", "ALL"):
        assert domain in out


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{not json", "'<json>'"),
        (json.dumps(_base(instruction="")), "'instruction'"),
        (json.dumps({k: v for k, v in _base().items() if k != "instruction"}), "'instruction'"),
        (json.dumps(_base(config=[{"parameters": {}}])), "'config[0].type'"),
        (json.dumps(_base(evaluator={"result": {}})), "'evaluator.func'"),
        (
            json.dumps(_base(evaluator={"func": ["a", "b"], "result": [{"type": "rule"}]})),
            "'evaluator.result'",
        ),
        (
            json.dumps(_base(evaluator={"func": "x", "postconfig": [{"type": ""}]})),
            "'evaluator.postconfig[0].type'",
        ),
        (json.dumps([1, 2]), "'<root>'"),
    ],
)
def test_malformed_file_names_file_and_field(tmp_path, text, field):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(TaskFormatError) as e:
        load_task(p)
    assert str(p) in str(e.value)
    assert field in str(e.value)


def test_unknown_types_recorded():
    t = load_task(
        _base(
            config=[{"type": "teleport", "parameters": {}}],
            evaluator={
                "func": ["no_such_metric", "exact_match"],
                "result": [{"type": "no_getter"}, {"type": "vm_command_line", "command": "x"}],
                "expected": [None, {"type": "rule", "rules": {"expected": 1}}],
            },
        )
    )
    assert unknown_types(t) == ("setup:teleport", "getter:no_getter", "metric:no_such_metric")
    cap = capabilities(t, "memory")
    assert isinstance(cap, NotRunnable)
    assert {(r.kind, r.detail) for r in cap.reasons} >= {
        (SETUP, "teleport"),
        (GETTER, "no_getter"),
        (METRIC, "no_such_metric"),
    }


def test_capabilities_remote_file_and_cache(tmp_path):
    url = "https://example.org/files/a%20b.txt"
    t = load_task(
        _base(config=[{"type": "download", "parameters": {"files": [{"url": url, "path": "/x"}]}}])
    )
    cap = capabilities(t, "memory", cache_dir=tmp_path)
    assert not cap and cap.reasons == (Reason(REMOTE_FILE, url),)
    # cached under the sha256 of the URL -> runnable
    (tmp_path / hashlib.sha256(url.encode()).hexdigest()).write_text("data")
    assert isinstance(capabilities(t, "memory", cache_dir=tmp_path), Runnable)


def test_capabilities_cache_by_task_and_basename(tmp_path):
    url = "https://example.org/x/report.xlsx"
    t = load_task(
        _base(
            id="tid",
            evaluator={
                "func": "exact_match",
                "result": {"type": "cloud_file", "path": url, "dest": "r.xlsx"},
                "expected": {"type": "rule", "rules": {"expected": 1}},
            },
        )
    )
    assert not capabilities(t, "memory", cache_dir=tmp_path)
    (tmp_path / "tid").mkdir()
    (tmp_path / "tid" / "report.xlsx").write_bytes(b"x")
    assert capabilities(t, "memory", cache_dir=tmp_path)


def test_capabilities_live_web_gdrive_login_and_options():
    t = load_task(
        _base(
            proxy=True,
            config=[
                {"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["https://x"]}},
                {"type": "googledrive", "parameters": {}},
                {"type": "login", "parameters": {}},
            ],
            evaluator={
                "func": "compare_table",
                "result": {"type": "vm_file", "path": "/a.xlsx", "dest": "a.xlsx"},
                "expected": {"type": "rule", "rules": {}},
                "options": {"rules": [{"type": "hologram"}]},
            },
        )
    )
    kinds = {r.kind for r in capabilities(t, "memory").reasons}
    assert {LIVE_WEB, GDRIVE, LOGIN, METRIC} <= kinds
    # network step types are reported as such, not also as "setup step unsupported"
    assert SETUP not in kinds


def test_capabilities_app_not_installed(monkeypatch):
    t = load_task(
        _base(
            config=[
                {"type": "launch", "parameters": {"command": ["gimp", "/x.png"]}},
                {
                    "type": "launch",
                    "parameters": {"command": "VLC_VERBOSE=-1 vlc x", "shell": True},
                },
                {"type": "open", "parameters": {"path": "/home/user/a.docx"}},
                {"type": "execute", "parameters": {"command": "cd /tmp && ls", "shell": True}},
            ]
        )
    )
    # the local backend answers what runs in its jail (LocalBackend.has_app)
    monkeypatch.setattr(LocalBackend, "has_app", staticmethod(lambda name: name == "ls"))
    cap = capabilities(t, "local")
    apps = {r.detail for r in cap.reasons if r.kind == APP}
    assert apps == {"gimp", "vlc", "soffice|libreoffice"}  # `cd` is a shell builtin
    # app checks are for host backends only
    assert APP not in {r.kind for r in capabilities(t, "memory").reasons}
    monkeypatch.setattr(LocalBackend, "has_app", staticmethod(lambda name: True))
    assert APP not in {r.kind for r in capabilities(t, "local").reasons}


def test_capabilities_backend_hook():
    # the memory backend reports programs its tiny desktop lacks
    t = load_task(_base(config=[{"type": "execute", "parameters": {"command": ["gsettings"]}}]))
    cap = capabilities(t, "memory")
    assert cap.reasons == (Reason(BACKEND, "memory desktop has no program 'gsettings'"),)


def test_local_runnable_count_is_reported(osworld_examples):
    runnable = [t for t in load_tasks(osworld_examples) if capabilities(t, "local")]
    # every runnable task has no remote file and only implemented types
    for t in runnable:
        assert not unknown_types(t)
        assert not t.proxy
    infeasible_no_setup = [
        t for t in load_tasks(osworld_examples) if t.evaluator.is_infeasible and not t.config
    ]
    assert set(t.id for t in infeasible_no_setup) <= set(t.id for t in runnable)


def test_relative_asset_resolves_against_task_dir(tmp_path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "f.txt").write_text("x")
    d = _base(
        config=[
            {
                "type": "download",
                "parameters": {"files": [{"url": "assets/f.txt", "path": "/home/user/f.txt"}]},
            }
        ]
    )
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    assert capabilities(load_task(p), "memory")
    (tmp_path / "assets" / "f.txt").unlink()
    assert not capabilities(load_task(p), "memory")


def test_task_path_and_domain(tmp_path):
    (tmp_path / "dom").mkdir()
    p = tmp_path / "dom" / "t.json"
    p.write_text(json.dumps(_base()))
    t = load_task(p)
    assert t.path == Path(p) and t.domain == "dom"


def test_capabilities_network_commands_and_sudo(monkeypatch):
    monkeypatch.setattr(LocalBackend, "has_app", staticmethod(lambda name: True))
    t = load_task(
        _base(
            config=[
                {
                    "type": "command",
                    "parameters": {
                        "command": "echo {CLIENT_PASSWORD} | sudo -S apt-get install -y jq",
                        "shell": True,
                    },
                }
            ]
        )
    )
    kinds = {r.kind for r in capabilities(t, "local").reasons}
    assert kinds == {LIVE_WEB, ROOT}
    # sudo is a host (jail) limit only; a real OSWorld VM has it
    assert ROOT not in {r.kind for r in capabilities(t, "memory").reasons}
    ok = load_task(_base(config=[{"type": "execute", "parameters": {"command": ["ls", "-l"]}}]))
    assert capabilities(ok, "local")


def test_runnable_cli_lists_tasks(tmp_path, capsys):
    from osworld_jax.testing.memory import write_word_tasks

    write_word_tasks(tmp_path, ["alpha", "beta"])
    assert report_main(["runnable", str(tmp_path), "--backend", "memory"]) == 0
    out = capsys.readouterr().out.split()
    assert out == ["memory_word/memory-word-alpha", "memory_word/memory-word-beta"]
    assert report_main(["runnable", str(tmp_path), "--backend", "local"]) == 0
    assert capsys.readouterr().out == ""  # memory-editor is not a host app
    assert [t.id for t in runnable_tasks(tmp_path, "memory")] == [
        "memory-word-alpha",
        "memory-word-beta",
    ]


def test_module_cli_runs_clean(osworld_examples):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "osworld_jax.env", "report", str(osworld_examples)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "tasks=369" in r.stdout
    assert "RuntimeWarning" not in r.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "osworld_jax.env", "report", "/nonexistent-dir"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "/nonexistent-dir does not exist" in bad.stderr


def test_assets_are_not_tasks(tmp_path):
    (tmp_path / "dom" / "assets" / "t1").mkdir(parents=True)
    (tmp_path / "dom" / "assets" / "t1" / "settings.json").write_text("{}")
    (tmp_path / "dom" / "t1.json").write_text(json.dumps(_base()))
    assert [p.name for p in T.iter_task_files(tmp_path)] == ["t1.json"]


def test_cache_layout_of_the_hf_file_cache_repo(tmp_path):
    from osworld_jax.env import cache

    url = (
        "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/"
        "os/23393935/hk_group_photo.jpg"
    )
    assert cache.resolve(url, tmp_path) is None
    (tmp_path / "os" / "23393935").mkdir(parents=True)
    (tmp_path / "os" / "23393935" / "hk_group_photo.jpg").write_bytes(b"jpg")
    assert cache.resolve(url, tmp_path) == tmp_path / "os" / "23393935" / "hk_group_photo.jpg"
    # no escaping the cache directory through the URL
    assert cache.cache_keys("https://h/resolve/main/../../etc/passwd")[1:] == ["passwd"]


def test_capabilities_backend_has_app_hook(monkeypatch):
    from osworld_jax.env.backends import BACKENDS

    t = load_task(_base(config=[{"type": "launch", "parameters": {"command": ["python", "x"]}}]))
    cls = BACKENDS.get("local")
    monkeypatch.setattr(
        cls, "has_app", classmethod(lambda c, name: name != "python"), raising=False
    )
    assert capabilities(t, "local").reasons == (Reason(APP, "python"),)
    monkeypatch.setattr(cls, "has_app", classmethod(lambda c, name: True), raising=False)
    assert capabilities(t, "local")


def test_instruction_with_web_address_needs_live_web():
    t = load_task(_base(instruction="Download the file from https://example.org/a.png please"))
    assert capabilities(t, "memory").reasons == (
        Reason(LIVE_WEB, "instruction names a web address (https://example.org/a.png)"),
    )
    # an infeasible task is scored by the FAIL answer alone
    inf = load_task(
        _base(instruction="Open https://x.org in Netscape 4", evaluator={"func": "infeasible"})
    )
    assert capabilities(inf, "memory")

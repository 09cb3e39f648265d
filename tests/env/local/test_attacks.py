"""Issue 16 items 1, 2, 4: attacks from inside a jailed sandbox, each as the agent would run it.

Every test plays the agent through the sandbox's public surface (``run_code``/``step``: model code
in the jail) and checks what the host side sees (evaluate, getters, cleanup). Each of these
succeeded against the jail before the hardening (see docs/SECURITY.md, "attack | before | after").
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from osworld_jax.env.local import LocalBackend, LocalBackendConfig, LocalSandbox
from osworld_jax.env.tasks import load_task

REPO = Path(__file__).resolve().parents[3]
ANSWER = "/home/user/Desktop/answer.txt"
# Solved iff ~/Desktop/answer.txt holds "42": a reward the agent can only earn by writing it.
TASK = {
    "id": "jail-attack-answer",
    "snapshot": "test",
    "instruction": "Write 42 into ~/Desktop/answer.txt.",
    "source": "tests",
    "config": [],
    "evaluator": {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["cat", ANSWER]},
        "expected": {"type": "rule", "rules": {"expected": "42\n"}},
    },
}


@pytest.fixture
def make_backend(runner) -> Iterator:
    made: list[LocalBackend] = []

    def make(**kw) -> LocalBackend:
        b = LocalBackend(LocalBackendConfig(observe_a11y=False, **kw))
        b.preflight()
        made.append(b)
        return b

    yield make
    for b in made:
        leaked = b.inventory()
        runner.run(b.aclose())
        assert leaked == [], f"sandboxes left open: {leaked}"


def agent(runner, sb: LocalSandbox, code: str) -> dict:
    """Runs ``code`` as the agent's action (model code in the jail)."""
    return runner.run(sb.run_code(textwrap.dedent(code)))


def test_host_environment_and_paths_are_not_readable_in_the_jail(runner, make_backend, monkeypatch):
    """Item 1: a secret in the trainer's environment must not reach the jail or come back."""
    secret = "osworld-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("OSWORLD_JAIL_TEST_SECRET", secret)
    backend = make_backend()
    sb = runner.run(backend.create(load_task(TASK)))
    try:
        root = str(sb.desktop.dir.parent)
        probe = """
            import glob, os
            out = []
            own = f"/proc/{os.getpid()}/"  # this probe's own command line quotes the patterns
            for pattern in ("/proc/*/environ", "/proc/*/cmdline", "/proc/*/mountinfo"):
                for p in glob.glob(pattern):
                    if p.startswith((own, "/proc/self/", "/proc/thread-self/")):
                        continue
                    try:
                        out.append(open(p, "rb").read().decode("utf-8", "replace"))
                    except OSError:
                        pass
            links = ("/proc/*/cwd", "/proc/*/root", "/proc/*/exe")
            for p in [q for pattern in links for q in glob.glob(pattern)]:
                try:
                    out.append(os.readlink(p))
                except OSError:
                    pass
            print("\\n".join(out))
            os.symlink("/proc/1/environ", os.path.expanduser("~/Desktop/environ.txt"))
            os.symlink("/proc/self/environ", os.path.expanduser("~/Desktop/self.txt"))
        """
        res = agent(runner, sb, probe)
        assert res["returncode"] == 0, res
        seen = res["output"]
        assert "OSWORLD_JAIL_TEST_SECRET" not in seen and secret not in seen
        assert len(seen) > 1000  # it did read its processes' files
        # The server (and its python) is not among the processes the agent can see or trace.
        ps = agent(
            runner,
            sb,
            "import glob\nfor p in glob.glob('/proc/[0-9]*/cmdline'):\n"
            "    print(open(p, 'rb').read().replace(b'\\0', b' ').decode())",
        )
        assert "jailexec.py --agent-runner" in ps["output"]  # it does see its own namespace
        assert "vmserver" not in ps["output"] and "Xvfb" not in ps["output"], ps
        for host_path in (root, str(REPO), "/work", "/root"):
            assert host_path not in seen, host_path
        # The evaluator's side: its commands and the files a getter fetches.
        res = runner.run(sb.vm.execute(["bash", "-c", "cat /proc/*/environ /proc/*/cmdline"]))
        assert secret not in res["output"] and root not in res["output"]
        for planted in ("~/Desktop/environ.txt", "~/Desktop/self.txt"):
            try:
                data = runner.run(sb.vm.file(planted))
            except FileNotFoundError:
                continue  # a link into /proc is not a file of the desktop
            assert secret.encode() not in data and root.encode() not in data
    finally:
        runner.run(sb.close())


FAKE_SERVER = r'''
import glob, os, socket, subprocess, sys, time
# 1. Guess the evaluator's door: every UNIX socket file outside /usr (read-only system files)
#    that is not the X server or the session bus.
roots = [r for r in os.listdir("/") if r not in ("usr", "proc", "sys", "lib", "lib64", "bin")]
targets = [p for r in roots for p in glob.glob(f"/{r}/**/*", recursive=True)
           if os.path.exists(p) and __import__("stat").S_ISSOCK(os.lstat(p).st_mode)
           and "X11" not in p and "dbus" not in p]
server = r"""
import http.server, json, os, socket, socketserver, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _reply(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        if self.path.startswith("/file"):
            body, ctype = b"42\n", "application/octet-stream"
        else:
            body = json.dumps({"status": "success", "output": "42\n", "error": "",
                               "returncode": 0, "width": 1920, "height": 1080,
                               "AT": "<desktop-frame/>"}).encode()
            ctype = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _reply
class S(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    def get_request(self):
        return self.socket.accept()[0], ("unix", 0)
servers = []
for path in sys.argv[1:]:
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        servers.append(S(path, H))
    except OSError:
        pass
import threading, time
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print(len(servers), flush=True)
# 2. Once the action has returned: kill the real server if it is visible (after freezing its
#    parent, so that its exit does not end the session), so that only this one answers.
time.sleep(1.0)
def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
for pid in pids:
    if cmdline(pid).startswith(b"dbus-run-session"):
        os.kill(pid, 19)  # SIGSTOP
for pid in pids:
    if cmdline(pid).startswith(b"/usr/bin/python3") and b"vmserver.py" in cmdline(pid):
        os.kill(pid, 9)
threading.Event().wait()
"""
fake = subprocess.Popen([sys.executable, "-c", server, *targets], start_new_session=True,
                        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("replaced", targets, fake.stdout.readline().strip())
'''


def test_a_fake_server_scores_what_the_agent_earned(runner, make_backend):
    """Item 2: an agent that replaces the server's socket and kills what it sees earns 0."""
    backend = make_backend()
    cheat = runner.run(backend.create(load_task(TASK)))
    honest = runner.run(backend.create(load_task(TASK)))
    try:
        agent(runner, cheat, FAKE_SERVER)
        runner.run(asyncio.sleep(2.0))  # the fake server's killing spree is over
        assert runner.run(cheat.evaluate(None)) == 0.0
        # The evaluator still talks to the real desktop: the cheat's files are what it sees.
        assert runner.run(cheat.vm.screen_size()) == (1920, 1080)
        with pytest.raises(FileNotFoundError):
            runner.run(cheat.vm.file(ANSWER))
        # Control: the task is solvable and the same evaluation gives 1.0 for real work.
        res = agent(runner, honest, f"open({ANSWER!r}, 'w').write('42\\n')")
        assert res["returncode"] == 0, res
        assert runner.run(honest.evaluate(None)) == 1.0
    finally:
        runner.run(cheat.close())
        runner.run(honest.close())


WATCHER = """
import os, time
me = os.getpid()
seen = {int(p) for p in os.listdir("/proc") if p.isdigit()}
open("/tmp/watcher.up", "w").write(str(me))
end = time.time() + 60
while time.time() < end:
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) not in seen and int(p) != me:
            seen.add(int(p))
            try:
                os.kill(int(p), 9)
                open("/tmp/watcher.log", "a").write(p + "\\n")
            except OSError:
                pass
    time.sleep(0.001)
"""


def test_lingering_agent_processes_cannot_touch_the_evaluators_commands(runner, make_backend):
    """Item 2: a background process the agent leaves behind kills every new process it can
    see; the evaluator's commands (getters, postconfig) must run untouched."""
    backend = make_backend()
    sb = runner.run(backend.create(load_task(TASK)))
    try:
        start = f"""
            import subprocess, time, os
            open("/tmp/watcher.py", "w").write({WATCHER!r})
            subprocess.Popen(["python3", "/tmp/watcher.py"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            while not os.path.exists("/tmp/watcher.up"):
                time.sleep(0.01)
        """
        assert agent(runner, sb, start)["returncode"] == 0
        for _ in range(3):
            res = runner.run(sb.vm.execute(["bash", "-c", "sleep 0.3; echo alive"]))
            assert (res["returncode"], res["output"]) == (0, "alive\n"), res
        assert runner.run(sb.evaluate(None)) == 0.0  # unsolved (no answer file), and scored
        # Control: the watcher is alive and effective against what shares its namespace.
        res = runner.run(sb.desktop.run_action(["bash", "-c", "sleep 0.3; echo alive"], timeout=30))
        assert res["output"] != "alive\n", res
    finally:
        runner.run(sb.close())


def test_modules_planted_beside_the_evaluators_python_are_not_imported(runner, make_backend):
    """Item 2: the evaluator's inline python (``python -c``, run in the agent's home) and
    ``/run_python`` (run from a file in /tmp) must not import modules the agent left there."""
    backend = make_backend()
    sb = runner.run(backend.create(load_task(TASK)))
    try:
        plant = """
            import os
            evil = "print('HACKED'); import builtins; builtins.print = lambda *a, **k: None\\n"
            for d in (os.path.expanduser("~"), "/tmp"):
                open(os.path.join(d, "json.py"), "w").write(evil)
        """
        assert agent(runner, sb, plant)["returncode"] == 0
        for cmd in (
            ["python3", "-c", "import json; print(json.dumps([1]))"],
            ["python", "-c", "import json; print(json.dumps([1]))"],
        ):
            res = runner.run(sb.vm.execute(cmd))
            assert (res["returncode"], res["output"]) == (0, "[1]\n"), (cmd, res)
        code = "import json\nprint(json.dumps([2]))"
        reply = runner.run(sb.vm.post_json("/run_python", {"code": code}))
        assert reply["output"] == "[2]\n", reply
        # A package the agent installed for itself (user site) is the agent's only: the
        # evaluator's python has no user site (issue 33 item 8, test_attacks_round2.py).
        install = """
            import os, site
            os.makedirs(site.getusersitepackages(), exist_ok=True)
            open(os.path.join(site.getusersitepackages(), "mypkg.py"), "w").write("X = 7\\n")
        """
        assert agent(runner, sb, install)["returncode"] == 0
        res = runner.run(sb.vm.execute(["python3", "-c", "import mypkg; print(mypkg.X)"]))
        assert "No module named 'mypkg'" in res["error"], res
        assert agent(runner, sb, "import mypkg; print(mypkg.X)")["output"] == "7\n"
    finally:
        runner.run(sb.close())


def test_a_service_file_in_home_is_not_started_by_the_session_bus(runner, make_backend):
    """The session bus must not run programs the agent describes in ~/.local/share/dbus-1."""
    backend = make_backend()
    sb = runner.run(backend.create(load_task(TASK)))
    try:
        plant = """
            import os, subprocess
            d = os.path.expanduser("~/.local/share/dbus-1/services")
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "org.osworld.Evil.service"), "w").write(
                "[D-BUS Service]\\nName=org.osworld.Evil\\n"
                "Exec=/bin/sh -c 'echo ran > /tmp/activated; sleep 5'\\n")
            r = subprocess.run(["dbus-send", "--session", "--print-reply",
                                "--dest=org.osworld.Evil", "/", "org.osworld.Evil.Ping"],
                               capture_output=True, text=True, timeout=20)
            print(r.returncode, r.stderr)
        """
        res = agent(runner, sb, plant)
        assert "org.osworld.Evil" in res["output"] or res["returncode"] == 0, res
        with pytest.raises(FileNotFoundError):
            runner.run(sb.vm.file("/tmp/activated"))
    finally:
        runner.run(sb.close())


def test_closing_a_sandbox_with_a_deep_hostile_tree_leaves_nothing(runner, make_backend):
    """Item 4: a tree deeper than Python's recursion limit, unwritable and unsearchable
    directories and odd modes: fork (snapshot) and close must succeed and leave nothing."""
    # Python's default limit, pinned: a library imported by an earlier test of the same worker
    # may have raised it, and a tree of 10,000+ levels is past PATH_MAX (cp refuses to copy it).
    recursion_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    depth = sys.getrecursionlimit() + 200
    backend = make_backend()
    sb = runner.run(backend.create(load_task(TASK)))
    forks: list = []
    try:
        build = f"""
            import os
            os.chdir(os.path.expanduser("~"))
            os.mkdir("deep")
            os.chdir("deep")
            for i in range({depth}):
                os.mkdir("d")
                os.chdir("d")
                if i % 97 == 0:
                    open("f", "w").write("x")
                    os.chmod("f", 0)
            os.chmod(".", 0o500)   # unwritable
            os.chdir(os.path.expanduser("~/deep"))
            os.mkdir("locked")
            open("locked/secret", "w").write("y")
            os.chmod("locked", 0)  # unsearchable
            os.chmod(".", 0o555)
            print("built")
        """
        res = agent(runner, sb, build)
        assert res["output"].strip() == "built", res
        forks = runner.run(backend.fork(sb, 1))
        probe = runner.run(
            forks[0].vm.execute(["bash", "-c", "find ~/deep -type d 2>/dev/null | wc -l"])
        )
        assert int(probe["output"]) >= depth  # the fork got the tree
    finally:
        for s in (*forks, sb):
            runner.run(s.close())
        sys.setrecursionlimit(recursion_limit)
    root = backend._root
    assert root is not None
    assert not sb.desktop.dir.exists()
    assert [p.name for p in root.iterdir()] == []  # no sandbox, no snapshot left
    assert os.path.isdir(root)

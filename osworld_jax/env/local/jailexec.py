"""Running commands inside the jail: output caps, wall-clock limits, nested pid namespaces.

Runs INSIDE the bubblewrap jail with the system ``python3`` (standard library only; it must not
import ``osworld_jax``). Used by the trusted in-jail server (``vmserver.py``) and, started as
``jailexec.py --agent-runner FD``, as the agent runner.

Two kinds of namespace keep the server out of reach of anything the agent runs (see
``docs/SECURITY.md``):

- the **desktop namespace**: one nested user + pid namespace (``bwrap --unshare-user
  --unshare-pid``) started with the desktop, whose first process is the agent runner. The agent's
  actions and every program started on the desktop (``launch``/``open`` steps, programs the
  agent starts) live there. Its processes cannot see, signal or ptrace the server: it is not in
  their pid namespace. If the runner dies (the agent killed it), the namespace and everything in
  it die, and the server starts a fresh one for the next request.
- a **throwaway namespace** per trusted command (``/execute``, ``/run_python``, ...: setup,
  postconfig and getter commands): the command runs in its own nested pid namespace, so processes
  the agent left running can neither see nor ptrace it, and it ends with the command. The
  evaluator's python (``python -c``, ``/run_python``) runs with ``ISOLATED_PYTHON_ENV``; a
  script the server hands a command is a memory file passed as a descriptor (``pass_fds``).

Every command's stdout and stderr are read up to ``max_output`` bytes each; past that, or past its
wall-clock ``timeout``, its whole process group is killed and the result says which limit hit.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

#: Environment variables passed from the server to the commands it runs (the jail's allow-list).
ENV_ALLOW = (
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "PATH",
    "LANG",
    "XDG_RUNTIME_DIR",
    "PYTHONPATH",
    "PYTHONDONTWRITEBYTECODE",
    "DISPLAY",
    "GTK_A11Y",
    "NO_AT_BRIDGE",
    "QT_ACCESSIBILITY",
    "SAL_USE_VCLPLUGIN",
    "DBUS_SESSION_BUS_ADDRESS",
)
#: For the evaluator's python (``python -c`` through ``/execute``, and ``/run_python``): a fixed
#: ``sys.path``. The current directory (the agent's home) and the script's directory are not put
#: on it (``PYTHONSAFEPATH``), so a module the agent left there (``~/json.py``) is not imported in
#: place of the real one; the agent's user site-packages (``~/.local/lib/python3.X/site-packages``)
#: is not added (``PYTHONNOUSERSITE``), so neither its ``.pth`` files nor ``usercustomize`` run
#: and nothing installed there shadows a module. What remains: ``PYTHONPATH`` (the read-only shim
#: directory), the standard library and the system's dist-packages, all read-only in the jail.
ISOLATED_PYTHON_ENV = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}
JAIL_UID = "1000"
BWRAP = "/usr/bin/bwrap"
#: After a command exits, how long its output is still read (programs it started in the
#: background, such as an app opened with Popen, keep its pipes open indefinitely).
EXIT_DRAIN_S = 0.5


def jail_env(extra: dict | None = None) -> dict:
    """The allow-listed part of this process's environment, plus ``extra``."""
    env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    env.update(extra or {})
    return env


def nested_argv(argv: list, *, cwd: str | None, env: dict) -> list:
    """``argv`` wrapped in a new user + pid namespace with its own /proc (same files, same uid)."""
    out = [BWRAP, "--unshare-user", "--unshare-pid", "--disable-userns", "--die-with-parent"]
    out += ["--uid", JAIL_UID, "--gid", JAIL_UID, "--dev-bind", "/", "/", "--proc", "/proc"]
    out += ["--clearenv"]
    for k, v in env.items():
        out += ["--setenv", k, v]
    if cwd:
        out += ["--chdir", cwd]
    return out + ["--", *argv]


def expand(command, shell: bool):
    """Upstream's argument handling: a string is shlex-split unless ``shell``; ``~/`` expanded."""
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if isinstance(command, str):
        return command
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        raise ValueError("command must be a string or a list of strings")
    return [os.path.expanduser(a) if a.startswith("~/") else a for a in command]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_capped(
    argv,
    *,
    shell: bool = False,
    timeout: float,
    max_output: int,
    cwd: str | None = None,
    env: dict | None = None,
    merge_stderr: bool = False,
    stdin_data: bytes | None = None,
    pass_fds: tuple[int, ...] = (),
) -> dict:
    """Runs a command to completion in its own session, reading at most ``max_output`` bytes.

    Returns ``{status, output, error, returncode}`` (text decoded as UTF-8 with replacement) and,
    when a limit stopped the command, ``limit`` (``"output"`` or ``"time"``). A command that
    cannot start is a result (returncode 127 / 126), not an exception. Once the command itself
    has exited, its output is read for ``EXIT_DRAIN_S`` more; background programs it started are
    left running (upstream's ``subprocess.run`` would wait for them until its timeout).
    """
    try:
        proc = subprocess.Popen(
            argv,
            shell=shell,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except FileNotFoundError as e:
        return {"status": "error", "output": "", "error": str(e), "returncode": 127}
    except PermissionError as e:
        return {"status": "error", "output": "", "error": str(e), "returncode": 126}
    if stdin_data is not None and proc.stdin is not None:
        try:
            proc.stdin.write(stdin_data)
        except OSError:
            pass
        proc.stdin.close()
    bufs = {"out": bytearray(), "err": bytearray()}
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    if proc.stderr is not None:
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
    end = time.monotonic() + timeout
    limit = None
    drain_until = None  # set when the command has exited: programs it started may hold the pipes
    while sel.get_map():
        now = time.monotonic()
        if drain_until is None and proc.poll() is not None:
            drain_until = now + EXIT_DRAIN_S
        if drain_until is not None and now >= drain_until:
            break  # the command is done; what it left running keeps running, unread
        left = end - now
        if left <= 0:
            limit = "time"
            break
        wait = min(left, 0.2 if drain_until is None else drain_until - now)
        for key, _ in sel.select(wait):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.data]
            buf += chunk
            if len(buf) > max_output:
                del buf[max_output:]
                limit = "output"
        if limit:
            break
    if limit:
        _kill_group(proc)
    sel.close()
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()
    try:
        rc = proc.wait(timeout=max(0.1, end - time.monotonic()) if not limit else 5)
    except subprocess.TimeoutExpired:
        limit = limit or "time"
        _kill_group(proc)
        rc = proc.wait()
    out = bufs["out"].decode("utf-8", "replace")
    err = bufs["err"].decode("utf-8", "replace")
    if limit == "time":
        return {
            "status": "error",
            "output": out,
            "error": f"command timed out after {timeout:g} s",
            "returncode": -9,
            "limit": "time",
        }
    res = {"status": "success", "output": out, "error": err, "returncode": rc}
    if limit == "output":
        res.update(status="error", limit="output", returncode=-9)
        res["error"] = f"command output exceeded {max_output} bytes; the command was killed"
    return res


def _inline_python(argv: list) -> bool:
    """``python[3[.X]] ... -c CODE``: code given on the command line, not a script file."""
    name = os.path.basename(argv[0]) if argv else ""
    is_python = name in ("python", "python3") or name.startswith("python3.")
    return is_python and "-c" in argv[1:]


def run_trusted(
    command, *, shell: bool, timeout: float, max_output: int, cwd=None, isolated=False, **kw
) -> dict:
    """Runs a setup/evaluation command in a throwaway nested pid namespace (module docstring).

    ``isolated`` (and any ``python -c``): the evaluator's python, ``ISOLATED_PYTHON_ENV``.
    """
    argv = expand(command, shell)
    if shell:
        argv = ["/bin/sh", "-c", argv]
    elif not argv:
        return {"status": "error", "output": "", "error": "empty command", "returncode": 127}
    elif "/" not in argv[0] and shutil.which(argv[0]) is None:
        err = f"[Errno 2] No such file or directory: {argv[0]!r}"
        return {"status": "error", "output": "", "error": err, "returncode": 127}
    extra = ISOLATED_PYTHON_ENV if isolated or _inline_python(argv) else {}
    wrapped = nested_argv(argv, cwd=cwd or os.getcwd(), env=jail_env(extra))
    return run_capped(wrapped, timeout=timeout, max_output=max_output, **kw)


# ----------------------------------------------------------------------------------------------
# The desktop namespace: the agent runner (inside it) and its handle (in the server).


def _send(sock: socket.socket, obj: dict) -> None:
    # UTF-8, not \uXXXX escapes: text decoded with replacement stays within 3 bytes a byte.
    sock.sendall(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")


def _recv(sock: socket.socket, max_bytes: int, buf: bytearray) -> dict | None:
    """One JSON line (None at EOF); a line longer than ``max_bytes`` is a protocol error."""
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > max_bytes:
            raise ValueError(f"reply longer than {max_bytes} bytes")
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("reply is not a JSON object")
    return obj


def agent_runner(fd: int) -> int:
    """The desktop namespace's first process: runs actions and starts programs on request."""
    sock = socket.socket(fileno=fd)
    children: list[subprocess.Popen] = []

    def reap(*_) -> None:
        """Reaps the started programs that ended, at once, only these, by pid.

        A killed app left as a zombie would still show in ``pgrep`` to the agent's next command.
        """
        children[:] = [c for c in children if c.poll() is None]

    signal.signal(signal.SIGCHLD, reap)
    buf = bytearray()
    while True:
        req = _recv(sock, 1 << 30, buf)
        if req is None:
            return 0
        reap()
        try:
            if req["op"] == "run":
                res = run_capped(
                    expand(req["command"], req.get("shell", False)),
                    shell=req.get("shell", False),
                    timeout=float(req["timeout"]),
                    max_output=int(req["max_output"]),
                    cwd=req.get("cwd"),
                )
            elif req["op"] == "spawn":
                command = expand(req["command"], req.get("shell", False))
                children.append(
                    subprocess.Popen(
                        command,
                        shell=req.get("shell", False),
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
                res = {"ok": True}
            else:
                res = {"error": f"unknown op {req['op']!r}"}
        except (OSError, ValueError, KeyError, TypeError) as e:
            res = {"error": str(e), "errno": getattr(e, "errno", None)}
        _send(sock, res)


class DesktopNamespace:
    """The server's handle on the desktop namespace (started lazily, restarted when it died)."""

    def __init__(self, runner_path: str, *, max_reply: int, on_start=None) -> None:
        """``on_start(ns)`` runs after each (re)start, e.g. to start the window manager."""
        self._runner = runner_path
        self._max_reply = max_reply
        self._on_start = on_start
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self.restarts = -1

    def start(self) -> None:
        """Starts the namespace now (it is also started on demand)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def _start(self) -> None:
        self.close()
        mine, theirs = socket.socketpair()
        argv = nested_argv(
            ["/usr/bin/python3", "-I", self._runner, "--agent-runner", str(theirs.fileno())],
            cwd=os.environ.get("HOME", "/"),
            env=jail_env(),
        )
        self._proc = subprocess.Popen(
            argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True
        )
        theirs.close()
        self._sock, self._buf = mine, bytearray()
        self.restarts += 1
        if self._on_start is not None:
            self._on_start(self)

    def request(self, req: dict, timeout: float) -> dict:
        """Sends one request to the runner; restarts the namespace when it is gone or broken.

        Requests are serialized (one runner, one conversation at a time).
        """
        with self._lock:
            return self._request(req, timeout)

    def _request(self, req: dict, timeout: float) -> dict:
        for attempt in (0, 1):
            if self._sock is None or self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._sock is not None
            self._sock.settimeout(timeout)
            try:
                _send(self._sock, req)
                reply = _recv(self._sock, self._max_reply, self._buf)
            except (OSError, ValueError) as e:
                self.close()  # a hung, dead or misbehaving runner: the namespace is replaced
                if attempt or req.get("op") == "run":
                    return {"error": f"desktop namespace runner failed: {e}"}
                continue
            if reply is not None:
                return reply
            self.close()
            if req.get("op") == "run":
                return {"error": "desktop namespace runner exited"}
        return {"error": "desktop namespace runner exited"}

    def close(self) -> None:
        """Kills the namespace (and everything in it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            _kill_group(self._proc)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--agent-runner":
        sys.exit(agent_runner(int(sys.argv[2])))
    sys.exit(f"usage: {sys.argv[0]} --agent-runner FD")

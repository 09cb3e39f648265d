"""Issue 16 item 3: per-sandbox limits of the local backend, each configurable and enforced.

Processes and memory (a cgroup per jail; the rlimit fallback without one), disk (size-capped
tmpfs), output (replies the host reads), wall-clock per action. Each test plays the agent through
``run_code``/``step`` and checks what the host, the sandbox's siblings and other runs see.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from osworld_jax.env.actions import parse_action
from osworld_jax.env.backend import PreflightError, SandboxError, SandboxLimitError
from osworld_jax.env.local import LocalBackend, LocalBackendConfig, LocalSandbox, limits
from osworld_jax.env.local import backend as local_backend
from osworld_jax.env.tasks import load_task
from osworld_jax.env.vm_client import SandboxOutputLimit

TASK = {
    "id": "jail-limits",
    "snapshot": "test",
    "instruction": "Nothing.",
    "source": "tests",
    "config": [],
    "evaluator": {
        "func": "exact_match",
        "result": {"type": "vm_file", "path": "/home/user/Desktop/out.txt", "dest": "out.txt"},
        "expected": {"type": "rule", "rules": {"expected": "x"}},
    },
}
MiB = 1 << 20
ROOT = os.geteuid() == 0
HAS_CGROUP = limits.detect("auto").version is not None


@pytest.fixture
def make_backend(runner) -> Iterator:
    made: list[LocalBackend] = []

    def make(**kw) -> LocalBackend:
        b = LocalBackend(LocalBackendConfig(observe_a11y=False, observe_terminal=False, **kw))
        b.preflight()
        made.append(b)
        return b

    yield make
    for b in made:
        leaked = b.inventory()
        runner.run(b.aclose())
        assert leaked == [], f"sandboxes left open: {leaked}"


def create(runner, backend: LocalBackend) -> LocalSandbox:
    return runner.run(backend.create(load_task(TASK)))


def act(runner, sb: LocalSandbox, code: str):
    """One agent step (model code in the jail), as AgentEnv runs it."""
    return runner.run(sb.step(parse_action(f"```python\n{textwrap.dedent(code)}\n```")))


def run(runner, sb: LocalSandbox, code: str) -> dict:
    return runner.run(sb.run_code(textwrap.dedent(code)))


SPAWN = """
    import subprocess
    started, refused = [], 0
    for _ in range({n}):
        try:
            started.append(subprocess.Popen(["sleep", "{hold}"]))
        except OSError:
            refused += 1
    print(len(started), refused)
"""


def _fork_bomb_isolation(runner, make_backend, **kw) -> None:
    run_a = make_backend(**kw)
    run_b = make_backend(**kw)  # another run on the same machine
    bomber, sibling = create(runner, run_a), create(runner, run_a)
    other_run = create(runner, run_b)
    try:
        res = run(runner, bomber, SPAWN.format(n=400, hold=8))
        started, refused = map(int, res["output"].split())
        assert refused > 0 and started < kw["max_processes"], res
        # While the bomb holds every process it may have: the others start 60 each.
        for victim in (sibling, other_run):
            res = run(runner, victim, SPAWN.format(n=60, hold=1))
            assert res["output"].split() == ["60", "0"], res
    finally:
        for s in (bomber, sibling, other_run):
            runner.run(s.close())


@pytest.mark.skipif(not HAS_CGROUP, reason="needs a pids cgroup (CI and this machine have v1)")
def test_a_fork_bomb_is_confined_to_its_sandbox_and_masks_it(runner, make_backend):
    _fork_bomb_isolation(runner, make_backend, max_processes=128)
    # The bomber's own next step names the breach (its owner is masked).
    backend = make_backend(max_processes=128)
    sb = create(runner, backend)
    try:
        with pytest.raises(SandboxLimitError, match="process limit of 128") as e:
            act(runner, sb, SPAWN.format(n=300, hold=3))
        assert e.value.limit == "processes"
    finally:
        runner.run(sb.close())


@pytest.mark.skipif(not ROOT, reason="the fallback gives each jail its own host uid (root only)")
def test_without_cgroups_each_sandbox_gets_its_own_uid_and_process_limit(runner, make_backend):
    backend = make_backend(cgroup="none", max_processes=128)
    assert backend.limit_mechanisms()["processes"].startswith("RLIMIT_NPROC")
    _fork_bomb_isolation(runner, make_backend, cgroup="none", max_processes=128)


@pytest.mark.skipif(not HAS_CGROUP, reason="needs a memory cgroup (CI and this machine have v1)")
def test_exceeding_the_memory_limit_masks_the_owner(runner, make_backend):
    backend = make_backend(memory_bytes=384 * MiB)
    sb, sibling = create(runner, backend), create(runner, backend)
    try:
        fine = "b = bytearray(64 << 20); print('ok')"
        assert run(runner, sb, fine)["output"] == "ok\n"
        with pytest.raises(SandboxLimitError, match="memory limit of 402653184 bytes") as e:
            act(runner, sb, "b = bytearray(1 << 30)\nprint(len(b))")
        assert e.value.limit == "memory"
        assert run(runner, sibling, fine)["output"] == "ok\n"
        runner.run(sibling.step(parse_action("WAIT")))  # no breach: no error
    finally:
        runner.run(sb.close())
        runner.run(sibling.close())


@pytest.mark.skipif(not ROOT, reason="the rlimit fallback runs jails as their own uid (root)")
def test_without_cgroups_memory_is_an_address_space_limit(runner, make_backend):
    backend = make_backend(cgroup="none", memory_bytes=1 << 30)
    assert backend.limit_mechanisms()["memory"] == "RLIMIT_AS per process"
    sb = create(runner, backend)
    try:
        res = run(runner, sb, "b = bytearray(2 << 30)")
        assert res["returncode"] != 0 and "MemoryError" in res["error"], res
        assert run(runner, sb, "print('alive')")["output"] == "alive\n"
    finally:
        runner.run(sb.close())


def test_writable_areas_are_size_capped(runner, make_backend):
    backend = make_backend(home_bytes=64 * MiB, tmp_bytes=32 * MiB, shm_bytes=8 * MiB)
    sb = create(runner, backend)
    try:
        sizes = run(
            runner,
            sb,
            "import os\nfor d in ('~', '/tmp', '/dev/shm', '/var/tmp'):\n"
            "    st = os.statvfs(os.path.expanduser(d))\n"
            "    print(st.f_blocks * st.f_frsize >> 20)",
        )
        assert sizes["output"].split() == ["64", "32", "8", "8"], sizes
        fill = """
            import errno, os
            for d, mb in (("~/Desktop", 100), ("/tmp", 50), ("/dev/shm", 20)):
                path = os.path.join(os.path.expanduser(d), "fill")
                try:
                    with open(path, "wb") as f:
                        for _ in range(mb):
                            f.write(b"x" * (1 << 20))
                    print(d, "wrote all")
                except OSError as e:
                    print(d, errno.errorcode[e.errno], os.path.getsize(path) >> 20)
        """
        out = run(runner, sb, fill)["output"].splitlines()
        assert [line.split()[:2] for line in out] == [
            ["~/Desktop", "ENOSPC"],
            ["/tmp", "ENOSPC"],
            ["/dev/shm", "ENOSPC"],
        ]
        assert [int(line.split()[2]) <= cap for line, cap in zip(out, (64, 32, 8), strict=True)]
        # The sandbox still works, and the host directory of the sandbox holds none of it.
        assert run(runner, sb, "print('alive')")["output"] == "alive\n"
        host_bytes = sum(p.stat().st_size for p in sb.desktop.dir.rglob("*") if p.is_file())
        assert host_bytes < MiB
    finally:
        runner.run(sb.close())


def test_output_over_the_cap_masks_the_owner(runner, make_backend):
    backend = make_backend(max_output_bytes=1 * MiB, max_file_bytes=2 * MiB)
    sb = create(runner, backend)
    try:
        with pytest.raises(SandboxLimitError, match="output exceeded 1048576 bytes") as e:
            act(runner, sb, "import sys\nsys.stdout.write('y' * (3 << 20))")
        assert e.value.limit == "output_bytes"
        with pytest.raises(SandboxOutputLimit):  # a getter's command
            runner.run(sb.vm.execute(["bash", "-c", "yes | head -c 5000000"]))
        # A result file over the cap: never read into the host, the evaluation names the limit.
        run(runner, sb, "open('/home/user/Desktop/out.txt', 'wb').write(b'x' * (3 << 20))")
        with pytest.raises(SandboxOutputLimit, match="file_bytes|3145728") as e2:
            runner.run(sb.vm.file("/home/user/Desktop/out.txt"))
        assert e2.value.limit == "file_bytes"
        with pytest.raises(SandboxError, match="3145728 bytes"):
            runner.run(sb.evaluate(None))
        # Bytes that are not UTF-8 count as bytes (each becomes U+FFFD, 3 bytes in the reply).
        with pytest.raises(SandboxLimitError, match="output exceeded") as e3:
            act(runner, sb, "import sys\nsys.stdout.buffer.write(b'\\xff' * (3 << 20))")
        assert e3.value.limit == "output_bytes"
        res = run(runner, sb, "import sys\nsys.stdout.buffer.write(b'\\xff\\x00' * 450_000)")
        assert res["output"] == "\ufffd\x00" * 450_000
        # Within the caps everything still flows.
        assert len(runner.run(sb.vm.execute(["head", "-c", "900000", "/dev/zero"]))["output"])
        assert run(runner, sb, "print('small')")["output"] == "small\n"
    finally:
        runner.run(sb.close())


def test_the_host_never_reads_a_reply_over_its_body_cap(runner, make_backend):
    backend = make_backend(max_output_bytes=1 * MiB, max_file_bytes=1 * MiB)
    sb = create(runner, backend)
    try:
        client = sb.desktop.client
        assert client.max_body_bytes == backend.config.max_body_bytes
        client.max_body_bytes = 100_000  # tighter than the server's own caps
        with pytest.raises(SandboxOutputLimit, match="exceeds 100000 bytes"):
            runner.run(client.execute(["head", "-c", "500000", "/dev/zero"]))
    finally:
        runner.run(sb.close())


def test_each_action_has_a_wall_clock_limit(runner, make_backend):
    backend = make_backend(step_timeout_s=2.0)
    sb = create(runner, backend)
    try:
        hang = """
            import subprocess, time
            subprocess.Popen(["sleep", "300"])  # keeps the action's stdout open
            time.sleep(300)
        """
        t0 = time.monotonic()
        res = run(runner, sb, hang)
        assert time.monotonic() - t0 < 8.0
        assert res["returncode"] == -9 and "timed out after 2 s" in res["error"], res
        assert run(runner, sb, "print('next')")["output"] == "next\n"
        # What the action started died with it (its process group).
        ps = run(
            runner,
            sb,
            "import subprocess\nprint(subprocess.run(['ps', '-eo', 'args'],"
            " capture_output=True, text=True).stdout)",
        )
        assert "sleep 300" not in ps["output"]
    finally:
        runner.run(sb.close())


def test_preflight_refuses_limits_it_cannot_enforce(monkeypatch):
    none = limits.CgroupSupport(None, None, None, "no cgroup here (test)")
    monkeypatch.setattr(limits, "detect", lambda mode="auto": none)
    monkeypatch.setattr(local_backend.os, "geteuid", lambda: 1000)
    with pytest.raises(PreflightError, match="max_processes needs a pids cgroup or root"):
        LocalBackend(LocalBackendConfig()).limit_mechanisms()
    mech = LocalBackend(LocalBackendConfig(max_processes=None)).limit_mechanisms()
    assert mech["memory"] == "RLIMIT_AS per process" and "processes" not in mech
    with pytest.raises(PreflightError, match="no v1 memory cgroup"):
        LocalBackend(LocalBackendConfig(cgroup="v1", max_processes=None)).limit_mechanisms()
    with pytest.raises(ValueError, match="cgroup must be"):
        LocalBackendConfig(cgroup="v3")
    with pytest.raises(ValueError, match="memory_bytes must be > 0 or None"):
        LocalBackendConfig(memory_bytes=0)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_jail_cgroup_files(tmp_path: Path, version: str):
    """The limit and counter files of each cgroup version (on a plain directory tree)."""
    sup = limits.CgroupSupport(version, tmp_path / "pids", tmp_path / "mem")
    (tmp_path / "pids").mkdir()
    (tmp_path / "mem").mkdir()
    cg = limits.JailCgroup(sup, "sb", max_processes=77, memory_bytes=5 * MiB)
    assert (tmp_path / "pids/sb/pids.max").read_text() == "77"
    mem = tmp_path / "mem/sb"
    if version == "v2":
        assert (mem / "memory.max").read_text() == str(5 * MiB)
        (mem / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    else:
        assert (mem / "memory.limit_in_bytes").read_text() == str(5 * MiB)
        (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "pids/sb/pids.events").write_text("max 5\n")
    assert cg.oom_kills() == (2 if version == "v2" else 3)
    assert cg.forks_refused() == 5
    for f in list(mem.iterdir()) + list((tmp_path / "pids/sb").iterdir()):
        f.unlink()  # a real cgroup's files vanish with it
    cg.remove()
    assert not mem.exists() and not (tmp_path / "pids/sb").exists()


def test_remove_tree_handles_depth_and_hostile_modes(tmp_path: Path):
    root = tmp_path / "t"
    root.mkdir()
    fd = os.open(root, os.O_DIRECTORY)
    for _ in range(1500):  # deeper than the recursion limit (no recursion to build it either)
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o000, dir_fd=fd))
    os.chmod(f"/proc/self/fd/{fd}", 0o500)
    os.close(fd)
    os.chmod(root / "d", 0)
    os.symlink("/etc", root / "link")  # never followed
    limits.remove_tree(root)
    assert not root.exists() and Path("/etc/passwd").exists()


def test_stale_cgroups_are_swept_but_not_a_starting_jails(tmp_path: Path):
    """A crashed run's empty cgroup goes; one another run just made (still empty) stays."""
    sup = limits.CgroupSupport("v1", tmp_path / "pids", None)
    (tmp_path / "pids").mkdir()
    old, fresh = tmp_path / "pids" / "local-old", tmp_path / "pids" / "local-new"
    old.mkdir()
    fresh.mkdir()
    past = time.time() - limits.STALE_AFTER_S - 10
    os.utime(old, (past, past))
    assert limits.sweep_stale(sup) == [old]
    assert fresh.exists() and not old.exists()

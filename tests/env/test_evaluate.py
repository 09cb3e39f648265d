"""Getters, setup/postconfig steps and evaluate_task (infeasible, conj, transient retries)."""

import asyncio
import hashlib

import pytest

from osworld_jax.env.actions import parse_action
from osworld_jax.env.backend import SandboxCreateError, SandboxEvalError, SandboxStepError
from osworld_jax.env.evaluators import GETTERS, RetryingVM, evaluate_task
from osworld_jax.env.evaluators.registry import EvalContext
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tasks import SetupStep, load_task
from osworld_jax.env.vm_client import SandboxTransientError
from osworld_jax.testing.memory_desktop import MemoryDesktop


def run(coro):
    return asyncio.run(coro)


async def no_sleep(_):
    return None


def task(evaluator, config=(), **kw):
    return load_task(
        {"id": "t", "instruction": "x", "config": list(config), "evaluator": evaluator, **kw}
    )


DONE = parse_action("DONE")
FAIL = parse_action("FAIL")


# ------------------------------------------------------------------ getters


def test_vm_file_getter(tmp_path):
    vm = MemoryDesktop()
    vm.files["/home/user/a.txt"] = b"A"
    ctx = EvalContext(work_dir=tmp_path)
    g = GETTERS.get("vm_file")
    p = run(g(vm, {"path": "/home/user/a.txt", "dest": "a.txt"}, ctx))
    assert p == str(tmp_path / "a.txt") and (tmp_path / "a.txt").read_bytes() == b"A"
    assert run(g(vm, {"path": "/home/user/missing", "dest": "m"}, ctx)) is None
    multi = {"path": ["/home/user/a.txt", "/nope"], "dest": ["x", "y"], "multi": True, "gives": [1]}
    assert run(g(vm, multi, ctx)) is None  # one index gives the value itself, not a list
    with pytest.raises(SandboxEvalError, match="escapes"):
        run(g(vm, {"path": "/home/user/a.txt", "dest": "../evil"}, ctx))


def test_multi_file_getters_give_the_first_file_by_default(tmp_path):
    # Upstream's gives defaults to [0]: a multi getter without gives returns the first path
    # (a str); the other files are still fetched beside it (sheet_print reads the CSV there).
    vm = MemoryDesktop()
    vm.files["/home/user/b.xlsx"] = b"X"
    vm.files["/home/user/b-Sheet1.csv"] = b"C"
    vm.files["/home/user/c.txt"] = b"T"
    ctx = EvalContext(work_dir=tmp_path)
    g = GETTERS.get("vm_file")
    params = {
        "path": ["/home/user/b.xlsx", "/home/user/b-Sheet1.csv", "/home/user/c.txt"],
        "dest": ["b.xlsx", "b-Sheet1.csv", "c.txt"],
        "multi": True,
    }
    assert run(g(vm, params, ctx)) == str(tmp_path / "b.xlsx")
    assert (tmp_path / "b-Sheet1.csv").read_bytes() == b"C"
    # several indices give a list in file order, whatever order gives lists them in
    assert run(g(vm, {**params, "gives": [2, 0]}, ctx)) == [
        str(tmp_path / "b.xlsx"),
        str(tmp_path / "c.txt"),
    ]
    assert run(g(vm, {**params, "gives": []}, ctx)) == []


def test_command_getters_rule_and_terminal(tmp_path):
    vm = MemoryDesktop()
    ctx = EvalContext(work_dir=tmp_path)
    out = run(GETTERS.get("vm_command_line")(vm, {"command": "echo hi", "shell": True}, ctx))
    assert out == "hi\n"
    err = run(GETTERS.get("vm_command_error")(vm, {"command": ["cat", "/nope"]}, ctx))
    assert "No such file" in err
    assert run(GETTERS.get("rule")(vm, {"rules": {"expected": 1}}, ctx)) == {"expected": 1}
    vm.terminal_text = "$ ls\n"
    assert run(GETTERS.get("vm_terminal_output")(vm, {}, ctx)) == "$ ls\n"
    assert run(GETTERS.get("vm_screen_size")(vm, {}, ctx)) == {"width": 1920, "height": 1080}
    assert "<desktop-frame" in run(GETTERS.get("accessibility_tree")(vm, {}, ctx))


def test_cloud_and_cache_file_getters(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    url = "https://host/x/gold.txt"
    (cache / hashlib.sha256(url.encode()).hexdigest()).write_text("G")
    work = tmp_path / "work"
    work.mkdir()
    ctx = EvalContext(work_dir=work, cache_dir=cache)
    p = run(GETTERS.get("cloud_file")(MemoryDesktop(), {"path": url, "dest": "g.txt"}, ctx))
    assert open(p).read() == "G"
    with pytest.raises(SandboxEvalError, match="not in the local file cache"):
        run(GETTERS.get("cloud_file")(MemoryDesktop(), {"path": url + "2", "dest": "h"}, ctx))
    (work / "diff.out").write_text("")
    assert run(GETTERS.get("cache_file")(MemoryDesktop(), {"path": "diff.out"}, ctx)).endswith(
        "diff.out"
    )
    with pytest.raises(SandboxEvalError, match="postconfig"):
        run(GETTERS.get("cache_file")(MemoryDesktop(), {"path": "nope.out"}, ctx))


# ------------------------------------------------------------------ setup


def test_download_from_cache_and_missing_names_url(tmp_path):
    url = "https://host/files/in.txt"
    (tmp_path / "tid").mkdir()
    (tmp_path / "tid" / "in.txt").write_text("IN")
    vm = MemoryDesktop()
    step = SetupStep(
        type="download", parameters={"files": [{"url": url, "path": "/home/user/d/in.txt"}]}
    )
    run(run_setup([step], vm, ctx=SetupContext(cache_dir=tmp_path, task_id="tid")))
    assert vm.files["/home/user/d/in.txt"] == b"IN"
    missing = SetupStep(type="download", parameters={"files": [{"url": url + "x", "path": "/a"}]})
    with pytest.raises(SandboxCreateError, match="https://host/files/in.txtx"):
        run(run_setup([missing], vm, cache_dir=tmp_path))


def test_execute_until_launch_open_and_only_types(tmp_path):
    vm = MemoryDesktop()
    calls = []

    async def sleep(s):
        calls.append(s)

    steps = [
        SetupStep(type="command", parameters={"command": ["mkdir", "-p", "/home/user/p"]}),
        SetupStep(
            type="execute",
            parameters={
                "command": "echo ok > /home/user/p/f",
                "shell": True,
                "until": {"returncode": 0},
            },
        ),
        SetupStep(type="sleep", parameters={"seconds": 2}),
        SetupStep(type="launch", parameters={"command": ["mousepad", "/home/user/p/f"]}),
        SetupStep(type="activate_window", parameters={"window_name": "f - mousepad"}),
    ]
    run(run_setup(steps, vm, ctx=SetupContext(sleep=sleep)))
    assert vm.files["/home/user/p/f"] == b"ok\n" and calls == [2.0]
    assert vm.doc is not None and vm.doc.path == "/home/user/p/f"
    vm2 = MemoryDesktop()
    run(run_setup(steps, vm2, ctx=SetupContext(sleep=sleep), only_types={"sleep"}))
    assert calls == [2.0, 2.0] and "/home/user/p" not in vm2.dirs
    never = SetupStep(type="execute", parameters={"command": ["false"], "until": {"returncode": 0}})
    with pytest.raises(SandboxCreateError, match="never met"):
        run(run_setup([never], vm, ctx=SetupContext(sleep=sleep)))
    with pytest.raises(SandboxCreateError, match="not supported"):
        run(run_setup([SetupStep(type="teleport", parameters={})], vm))
    with pytest.raises(SandboxCreateError, match="missing parameter 'command'"):
        run(run_setup([SetupStep(type="launch", parameters={})], vm))


def test_launch_splits_a_string_command_on_whitespace_as_upstream():
    # Upstream's SetupController._launch_setup: a non-shell string of several words is
    # command.split() (quotes are literal characters), a one-word string goes as it is.
    vm = MemoryDesktop()
    cmd = "vlc '/home/user/My File.mp4'"
    run(run_setup([SetupStep(type="launch", parameters={"command": cmd})], vm))
    split = ["vlc", "'/home/user/My", "File.mp4'"]
    assert vm.log[-1] == f"launch {split!r}"
    run(run_setup([SetupStep(type="launch", parameters={"command": ["vlc", "a b"]})], vm))
    assert vm.log[-1] == f"launch {['vlc', 'a b']!r}"  # a list is left alone
    shell = SetupStep(type="launch", parameters={"command": cmd, "shell": True})
    run(run_setup([shell], vm))
    assert vm.log[-1] == f"launch {['vlc', '/home/user/My File.mp4']!r}"  # shell: unsplit


def test_vm_terminal_output_is_none_without_a_terminal(tmp_path):
    # Upstream's /terminal answers null when no terminal is found (not ""): check_include_exclude
    # scores None 0 whatever the rules (tasks 13584542, 4127319a).
    from osworld_jax.env.evaluators.registry import EvalContext

    vm = MemoryDesktop()
    getter, ctx = GETTERS.get("vm_terminal_output"), EvalContext(work_dir=tmp_path)
    vm.terminal_text = ""
    assert run(getter(vm, {}, ctx)) is None
    vm.terminal_text = "user@host:~$ stty size\n43 132"
    assert run(getter(vm, {}, ctx)) == "user@host:~$ stty size\n43 132"
    t = task(
        {"func": "check_include_exclude", "result": {"type": "vm_terminal_output"},
         "expected": {"type": "rule", "rules": {"include": [], "exclude": ["error"]}}}
    )  # fmt: skip
    vm.terminal_text = ""
    assert run(evaluate_task(t, vm, DONE)) == 0.0  # no terminal: None scores 0 (upstream)
    vm.terminal_text = "fine"
    assert run(evaluate_task(t, vm, DONE)) == 1.0


# ------------------------------------------------------------------ evaluate_task


def test_infeasible():
    t = task({"func": "infeasible"})
    assert run(evaluate_task(t, MemoryDesktop(), FAIL)) == 1.0
    assert run(evaluate_task(t, MemoryDesktop(), DONE)) == 0.0
    assert run(evaluate_task(t, MemoryDesktop(), None)) == 0.0


def _echo_task(conj, words, expected):
    return task(
        {
            "func": ["exact_match"] * len(words),
            "conj": conj,
            "result": [{"type": "vm_command_line", "command": ["echo", w]} for w in words],
            "expected": [{"type": "rule", "rules": {"expected": e + "\n"}} for e in expected],
        }
    )


def test_conj_and_or():
    vm = MemoryDesktop()
    assert run(evaluate_task(_echo_task("and", ["a", "b"], ["a", "b"]), vm, DONE)) == 1.0
    assert run(evaluate_task(_echo_task("and", ["a", "b"], ["a", "x"]), vm, DONE)) == 0.0
    assert run(evaluate_task(_echo_task("or", ["a", "b"], ["z", "b"]), vm, DONE)) == 1.0
    assert run(evaluate_task(_echo_task("or", ["a", "b"], ["z", "y"]), vm, DONE)) == 0.0
    # a FAIL answer on a feasible task scores 0 without evaluating
    assert run(evaluate_task(_echo_task("and", ["a"], ["a"]), vm, FAIL)) == 0.0


def test_and_mean_of_partial_scores(tmp_path):
    # diff_text_file gives partial credit 0.75 (see test_metrics); and -> mean(1.0, 0.75)
    vm = MemoryDesktop()
    vm.files["/home/user/a"] = b"a\nb\nc\nd\n"
    vm.files["/home/user/b"] = b"a\nb\nx\nd\n"
    t = task(
        {
            "func": ["exact_match", "diff_text_file"],
            "result": [
                {"type": "vm_command_line", "command": ["echo", "x"]},
                {"type": "vm_file", "path": "/home/user/a", "dest": "a"},
            ],
            "expected": [
                {"type": "rule", "rules": {"expected": "x\n"}},
                {"type": "vm_file", "path": "/home/user/b", "dest": "b"},
            ],
        }
    )
    assert run(evaluate_task(t, vm, DONE)) == pytest.approx((1.0 + 0.75) / 2)


def test_postconfig_stdout_and_cache_file():
    vm = MemoryDesktop()
    t = task(
        {
            "func": "check_list",
            "postconfig": [
                {
                    "type": "execute",
                    "parameters": {"command": ["ls", "/home/user"], "stdout": "ls.out"},
                }
            ],
            "result": {"type": "cache_file", "path": "ls.out"},
            "expected": {"type": "rule", "rules": {"expect": ["^Desktop$"], "unexpect": ["^x$"]}},
        }
    )
    assert run(evaluate_task(t, vm, DONE)) == 1.0


def test_work_dir_names_are_one_file_name_in_the_work_dir(tmp_path):
    """An execute step's stdout/stderr and the cache_file getter's path are joined onto the
    task's work dir (upstream's cache dir): ``../`` or an absolute path reached outside it (in
    postconfig the agent controls what is written, by root). Each is refused in one line naming
    the task and the field; the command does not run and nothing is written."""
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    ctx = SetupContext(work_dir=work, task_id="t-43")

    class Counting(MemoryDesktop):
        runs = 0

        async def execute(self, *a, **kw):
            Counting.runs += 1
            return await super().execute(*a, **kw)

    vm = Counting()
    for key in ("stdout", "stderr"):
        for name in ("../../x", str(tmp_path / "abs"), "..", "", "d/x"):
            if not name:
                continue  # empty: upstream's "do not save" (the default)
            step = SetupStep(type="execute", parameters={"command": ["ls"], key: name})
            with pytest.raises(SandboxCreateError) as refused:
                run(run_setup([step], vm, ctx=ctx))
            line = str(refused.value)
            assert "\n" not in line
            assert line.startswith(f"task t-43: setup step 'execute': {key} = ")
    assert Counting.runs == 0 and sorted(p.name for p in tmp_path.rglob("*")) == ["a", "work"]
    (tmp_path / "a" / "secret").write_text("S")
    ectx = EvalContext(work_dir=work, task_id="t-43")
    for name in ("../secret", str(tmp_path / "a" / "secret"), ["ok", "../secret"]):
        with pytest.raises(SandboxEvalError, match=r"^task t-43: getter cache_file: path = "):
            run(GETTERS.get("cache_file")(vm, {"path": name}, ectx))
    step = SetupStep(type="execute", parameters={"command": ["ls"], "stdout": "ok"})
    run(run_setup([step], vm, ctx=ctx))  # one name: written, read back
    assert run(GETTERS.get("cache_file")(vm, {"path": "ok"}, ectx)) == str(work / "ok")


class Flaky:
    """A VM whose first ``n`` calls fail with a transient 503 (or a permanent error)."""

    def __init__(self, inner, n, transient=True):
        self.inner, self.n, self.transient, self.calls = inner, n, transient, 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        async def call(*a, **k):
            self.calls += 1
            if self.n > 0:
                self.n -= 1
                if self.transient:
                    raise SandboxTransientError("HTTP 503", status=503)
                raise SandboxStepError("HTTP 400: bad request")
            return await fn(*a, **k)

        return call


def test_transient_errors_are_retried_not_scored_zero():
    t = _echo_task("and", ["a"], ["a"])
    vm = Flaky(MemoryDesktop(), n=2)
    assert run(evaluate_task(t, vm, DONE, attempts=3, sleep=no_sleep)) == 1.0
    assert vm.calls == 3
    vm = Flaky(MemoryDesktop(), n=3)
    with pytest.raises(SandboxEvalError, match="503"):
        run(evaluate_task(t, vm, DONE, attempts=3, sleep=no_sleep))
    vm = Flaky(MemoryDesktop(), n=1, transient=False)
    with pytest.raises(SandboxEvalError, match="400"):
        run(evaluate_task(t, vm, DONE, attempts=3, sleep=no_sleep))
    assert vm.calls == 1  # permanent errors are not retried


def test_retrying_vm_backoff():
    delays = []

    async def sleep(s):
        delays.append(s)

    vm = RetryingVM(Flaky(MemoryDesktop(), n=2), attempts=4, base_delay_s=0.5, sleep=sleep)
    assert run(vm.screen_size()) == (1920, 1080)
    assert delays == [0.5, 1.0] and vm.retries == 2


def test_unsupported_metric_or_crash_is_eval_error():
    t = task({"func": "compare_image_text", "result": {"type": "rule", "rules": {}}})
    with pytest.raises(SandboxEvalError, match="not supported"):
        run(evaluate_task(t, MemoryDesktop(), DONE))
    t2 = task(
        {
            "func": "exact_match",
            "result": {"type": "rule", "rules": {}},
            "expected": {"type": "rule", "rules": {}},
        }
    )  # no "expected" key -> KeyError
    with pytest.raises(SandboxEvalError, match="KeyError"):
        run(evaluate_task(t2, MemoryDesktop(), DONE))


def test_placeholders_filled_in_steps_and_getters():
    vm = MemoryDesktop(screen=(1000, 600))
    step = SetupStep(
        type="execute",
        parameters={
            "command": "echo {SCREEN_WIDTH_HALF}x{SCREEN_HEIGHT_HALF} {CLIENT_PASSWORD} "
            "> /home/user/p",
            "shell": True,
        },
    )
    run(run_setup([step], vm, ctx=SetupContext(client_password="pw")))
    assert vm.files["/home/user/p"] == b"500x300 pw\n"
    t = task(
        {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["echo", "{SCREEN_WIDTH}"]},
            "expected": {"type": "rule", "rules": {"expected": "1000\n"}},
        }
    )
    assert run(evaluate_task(t, vm, DONE)) == 1.0

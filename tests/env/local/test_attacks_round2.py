"""Issue 33 items 2 and 8: the jail's upstream endpoints cannot be forged by the agent.

Each test plays the agent through the sandbox's public surface (model code in the jail), then
calls the endpoints the evaluator side calls (``/run_python``, ``/run_bash_script``, ``/execute``
with ``python3 -c``) and checks that their replies are the evaluator's, not the agent's. Both
attacks succeeded before (docs/SECURITY.md, "attack | before | after").
"""

from __future__ import annotations

import textwrap

from osworld_jax.env.local import LocalSandbox
from osworld_jax.env.tasks import load_task
from tests.env.local.test_attacks import TASK, make_backend  # noqa: F401 - a fixture

# Rewrites every script that appears in /tmp (what the server wrote for /run_python and
# /run_bash_script) into one printing "FORGED", polling every millisecond until told to stop (at
# most 300 s: a loaded machine can take a minute between its start and the control below).
REWRITER = """
import os, time
open("/tmp/rewriter.up", "w").write("up")
done, end = {"rewriter.py"}, time.time() + 300
while time.time() < end and not os.path.exists("/tmp/rewriter.stop"):
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        if name in done or not name.endswith((".py", ".sh")):
            continue
        done.add(name)
        try:
            forged = "print('FORGED')\\n" if name.endswith(".py") else "echo FORGED\\n"
            open(path, "w").write(forged)
            open("/tmp/rewriter.log", "a").write(name + "\\n")
        except OSError:
            pass
    time.sleep(0.001)
"""


def agent(runner, sb: LocalSandbox, code: str) -> dict:
    return runner.run(sb.run_code(textwrap.dedent(code)))


def test_an_agent_process_cannot_rewrite_run_python_or_run_bash_scripts(runner, make_backend):  # noqa: F811
    """Item 2: a process the agent left running rewrote /tmp/python_exec_*.py and /tmp/tmp*.sh
    between writing and running: 3/3 replies were the agent's. The scripts are memory files."""
    sb = runner.run(make_backend().create(load_task(TASK)))
    try:
        start = f"""
            import subprocess, time, os
            open("/tmp/rewriter.py", "w").write({REWRITER!r})
            subprocess.Popen(["python3", "/tmp/rewriter.py"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for _ in range(1000):
                if os.path.exists("/tmp/rewriter.up"):
                    break
                time.sleep(0.01)
        """
        assert agent(runner, sb, start)["returncode"] == 0
        for i in range(3):
            reply = runner.run(sb.vm.post_json("/run_python", {"code": f"print({i} * 7)"}))
            assert reply["output"] == f"{i * 7}\n", reply
            body = {"script": f"echo bash {i}", "timeout": 30, "working_dir": None}
            reply = runner.run(sb.vm.post_json("/run_bash_script", body))
            assert reply["output"] == f"bash {i}\n", reply
        # Control: the rewriter is alive and forges a script written to /tmp (waited for: on a
        # loaded machine its next poll can be far more than a millisecond away). The script
        # appears whole (renamed into place): written in place, the rewriter could forge it
        # between our open and our buffered write, which then lands over the forgery.
        control = """
            import os, subprocess, time
            open("/tmp/control.part", "w").write("print('mine')")
            os.replace("/tmp/control.part", "/tmp/control.py")
            for _ in range(3000):
                if os.path.exists("/tmp/rewriter.log") and "control.py" in open(
                    "/tmp/rewriter.log"
                ).read():
                    break
                time.sleep(0.01)
            print(subprocess.run(["python3", "/tmp/control.py"], capture_output=True,
                                 text=True).stdout, end="")
            open("/tmp/rewriter.stop", "w").close()
            print(open("/tmp/rewriter.log").read(), end="")
        """
        res = agent(runner, sb, control)
        assert res["output"] == "FORGED\ncontrol.py\n", res  # it saw nothing of the evaluator's
    finally:
        runner.run(sb.close())


# A .pth in the agent's user site-packages that puts ~/evil first, where a fake json prints the
# agent's answer (and silences the real output).
PTH_ATTACK = """
import os, site
user_site = site.getusersitepackages()
os.makedirs(user_site, exist_ok=True)
evil = os.path.expanduser("~/evil")
os.makedirs(evil, exist_ok=True)
open(os.path.join(user_site, "zz.pth"), "w").write(f"import sys; sys.path.insert(0, {evil!r})\\n")
open(os.path.join(evil, "json.py"), "w").write(
    "import os, sys\\nsys.stdout.write('[\\"AGENT\\"]\\\\n'); sys.stdout.flush(); os._exit(0)\\n"
)
open(os.path.join(user_site, "usercustomize.py"), "w").write("print('USERCUSTOMIZE')\\n")
open(os.path.join(user_site, "mypkg.py"), "w").write("X = 7\\n")
"""


def test_the_agents_user_site_does_not_reach_the_evaluators_python(runner, make_backend):  # noqa: F811
    """Item 8: ``~/.local/lib/python3.X/site-packages/zz.pth`` putting ``~/evil`` first with a
    fake ``json.py`` made ``/run_python`` and ``/execute python3 -c`` print the agent's output."""
    sb = runner.run(make_backend().create(load_task(TASK)))
    try:
        assert agent(runner, sb, PTH_ATTACK)["returncode"] == 0
        code = "import json; print(json.dumps([1]))"
        for cmd in (
            ["python3", "-c", code],
            ["python", "-c", code],
            ["/usr/bin/python3", "-c", code],
        ):
            res = runner.run(sb.vm.execute(cmd))
            assert (res["returncode"], res["output"]) == (0, "[1]\n"), (cmd, res)
        reply = runner.run(sb.vm.post_json("/run_python", {"code": code}))
        assert reply["output"] == "[1]\n", reply
        res = runner.run(sb.vm.execute(["python3", "-c", "import mypkg"]))
        assert res["returncode"] == 1 and "No module named 'mypkg'" in res["error"], res
        # The shim directory on the evaluator's PYTHONPATH is not the agent's to write.
        res = agent(runner, sb, "open('/opt/osworld/lib/sitecustomize.py', 'w').write('x')")
        assert res["returncode"] != 0 and "Error" in res["error"], res
        # Control: the agent's own python does load its user site (the attack is live there).
        res = agent(runner, sb, "import json, mypkg; print(json.dumps([mypkg.X]))")
        assert "AGENT" in res["output"], res
    finally:
        runner.run(sb.close())


# Solved iff ~/Desktop/answer.txt equals the gold file a setup step writes (a vm_file getter).
FILE_TASK = {
    **TASK,
    "id": "jail-attack-result-file",
    "config": [
        {
            "type": "execute",
            "parameters": {"command": ["bash", "-c", "echo 42 > /home/user/gold.txt"]},
        }
    ],
    "evaluator": {
        "func": "compare_text_file",
        "result": {"type": "vm_file", "path": "/home/user/Desktop/answer.txt", "dest": "a.txt"},
        "expected": {"type": "vm_file", "path": "/home/user/gold.txt", "dest": "gold.txt"},
    },
}


def test_a_result_file_symlinked_to_a_root_only_file_scores_0(runner, make_backend):  # noqa: F811
    """Issue 33, "also look at": the result file symlinked to /etc/shadow made the evaluation
    raise, so the owner was masked (an agent expecting to fail dodged the penalty): now 0."""
    backend = make_backend()
    cheat = runner.run(backend.create(load_task(FILE_TASK)))
    honest = runner.run(backend.create(load_task(FILE_TASK)))
    try:
        res = agent(runner, cheat, "import os\nos.symlink('/etc/shadow', os.path.expanduser("
                    "'~/Desktop/answer.txt'))")  # fmt: skip
        assert res["returncode"] == 0, res
        assert runner.run(cheat.evaluate(None)) == 0.0  # was: SandboxRequestError (masked)
        # The same for a file the agent made unreadable to everyone.
        res = agent(runner, cheat, "import os\np = os.path.expanduser('~/Desktop/answer.txt')\n"
                    "os.unlink(p)\nopen(p, 'w').write('42\\n')\nos.chmod(p, 0)")  # fmt: skip
        assert res["returncode"] == 0, res
        assert runner.run(cheat.evaluate(None)) == 0.0
        # Control: the task is solvable.
        res = agent(runner, honest, "open('/home/user/Desktop/answer.txt', 'w').write('42\\n')")
        assert res["returncode"] == 0, res
        assert runner.run(honest.evaluate(None)) == 1.0
    finally:
        runner.run(cheat.close())
        runner.run(honest.close())

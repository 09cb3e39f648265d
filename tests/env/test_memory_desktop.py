"""The memory test desktop: its command interpreter, editor model and fork semantics."""

import asyncio

from osworld_jax.env.actions import parse_action
from osworld_jax.testing.memory import MemoryBackend, word_task
from osworld_jax.testing.memory_desktop import MemoryDesktop


def test_commands_and_redirection():
    d = MemoryDesktop()
    assert (
        d.run("mkdir -p ~/a/b && echo hi > ~/a/b/f; echo more >> ~/a/b/f", shell=True)["returncode"]
        == 0
    )
    assert d.files["/home/user/a/b/f"] == b"hi\nmore\n"
    assert d.run(["cat", "/home/user/a/b/f"])["output"] == "hi\nmore\n"
    assert d.run(["wc", "-l", "/home/user/a/b/f"])["output"].startswith("2 ")
    assert d.run("printf 'x=%s\\n' 1 2", shell=True)["output"] == "x=1\nx=2\n"
    r = d.run(["cat", "/nope"])
    assert r["returncode"] == 1 and "No such file" in r["error"]
    assert d.run(["gsettings"])["returncode"] == 127
    # `&&` stops at the first failure
    d.run("test -f /nope && echo yes > /home/user/y", shell=True)
    assert "/home/user/y" not in d.files
    d.run(["mv", "/home/user/a", "/home/user/c"])
    assert "/home/user/c/b/f" in d.files and "/home/user/a" not in d.dirs


def test_editor_model_and_agent_code_is_not_executed():
    d = MemoryDesktop()
    d.files["/home/user/n.txt"] = b"old\n"
    asyncio.run(d.launch(["mousepad", "/home/user/n.txt"]))
    d.act("pyautogui.hotkey('ctrl', 'a')\npyautogui.typewrite('new')")
    assert d.files["/home/user/n.txt"] == b"old\n"  # not saved yet
    d.act("import os\nos.remove('/etc/passwd')\npyautogui.hotkey('ctrl', 's')")
    assert d.files["/home/user/n.txt"] == b"new"
    assert any("os.remove" in entry for entry in d.log)  # logged, not run
    d.act("x = input()\npyautogui.typewrite(x)")  # non-literal arguments are ignored
    assert d.doc.buffer == "new"


def test_fork_copies_state_independently():
    be = MemoryBackend()

    async def main():
        base = await be.create(word_task("a"))
        f1, f2 = await be.fork(base, 2)
        await f1.step(parse_action("```python\npyautogui.typewrite('a')\n```"))
        assert f1.desktop.files["/home/user/answer.txt"] == b"a"
        assert f2.desktop.files["/home/user/answer.txt"] == b""
        assert sorted(be.inventory()) == sorted([base.id, f1.id, f2.id])
        for sb in (base, f1, f2):
            await sb.close()
            await sb.close()  # idempotent

    asyncio.run(main())
    assert be.inventory() == []


def test_observation_changes_with_state():
    be = MemoryBackend()

    async def main():
        sb = await be.create(word_task("a"))
        o1 = await sb.observe()
        o2 = await sb.step(parse_action("```python\npyautogui.typewrite('zz')\n```"))
        await sb.close()
        return o1, o2

    o1, o2 = asyncio.run(main())
    assert o1.screenshot != o2.screenshot and "zz" in o2.a11y_tree

"""The ``osworld`` backend: call sequence and error mapping against a fake ``desktop_env``
module injected into ``sys.modules`` (always runs), and the real package when installed."""

import asyncio
import importlib.util
import inspect
import os
import sys
import threading
import time
import types

import pytest

from osworld_jax.env.actions import parse_action
from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.backend import (
    PreflightError,
    SandboxCreateError,
    SandboxEvalError,
    SandboxStepError,
)
from osworld_jax.env.backends import BACKENDS
from osworld_jax.env.osworld_adapter import (
    OSWorldBackend,
    OSWorldBackendConfig,
    task_config_dict,
)
from osworld_jax.testing.memory import word_task

TYPE = "```python\npyautogui.typewrite({!r})\n```"
PNG = b"\x89PNG\r\n\x1a\nfake"


class FakeDesktopEnv:
    """Mimics upstream's DesktopEnv surface; records every call in ``FakeDesktopEnv.calls``."""

    calls: list = []
    lock = threading.Lock()
    reset_delay_s = 0.0

    def __init__(self, provider_name="vmware", path_to_vm=None, action_space="pyautogui", **kw):
        self.n = len([c for c in self.calls if c[0] == "init"])
        self._log("init", provider_name=provider_name, action_space=action_space, **kw)
        if provider_name == "broken":
            raise RuntimeError("no VM for you")
        self.typed = ""
        self.history = []
        self.task = None

    def _log(self, *call, **kw):
        with self.lock:
            self.calls.append((*call, kw) if kw else call)

    def _get_obs(self):
        return {
            "screenshot": PNG,
            "accessibility_tree": f"<text>{self.typed}</text>",
            "terminal": None,
            "instruction": self.task["instruction"],
        }

    def reset(self, task_config=None, seed=None, options=None):
        time.sleep(self.reset_delay_s)
        self._log("reset", task_config["id"])
        self.task = task_config
        return self._get_obs()

    def step(self, action, pause=2):
        self._log("step", action, pause)
        self.history.append(action)
        if "CRASH" in action:
            raise ConnectionError("VM went away")
        if "typewrite(" in action:
            self.typed += action.split("typewrite(")[1].split(")")[0].strip("'\"")
        return self._get_obs(), 0, action in ("DONE", "FAIL"), {}

    def evaluate(self):
        self._log("evaluate", self.history[-1] if self.history else None)
        if self.typed == "EVALBOOM":
            raise RuntimeError("getter exploded")
        if self.history and self.history[-1] == "FAIL":
            return 0
        expected = self.task["evaluator"]["expected"]["rules"]["expected"]
        return 1 if self.typed == expected else 0

    def close(self):
        self._log("close", self.n)


@pytest.fixture
def fake_upstream(monkeypatch):
    pkg = types.ModuleType("desktop_env")
    mod = types.ModuleType("desktop_env.desktop_env")
    mod.DesktopEnv = FakeDesktopEnv
    pkg.desktop_env = mod
    monkeypatch.setitem(sys.modules, "desktop_env", pkg)
    monkeypatch.setitem(sys.modules, "desktop_env.desktop_env", mod)
    FakeDesktopEnv.calls = []
    FakeDesktopEnv.reset_delay_s = 0.0
    return FakeDesktopEnv


def _names(calls):
    return [c[0] for c in calls]


def test_registered():
    assert BACKENDS.get("osworld") is OSWorldBackend


def test_call_sequence_create_step_evaluate_close(fake_upstream):
    async def main():
        be = OSWorldBackend(OSWorldBackendConfig(provider_name="docker", step_pause_s=0.0))
        be.preflight()
        task = word_task("hi")
        sb = await be.create(task)
        obs = await sb.observe()
        assert obs.screenshot == PNG and obs.instruction == task.instruction
        obs = await sb.step(parse_action(TYPE.format("hi")))
        assert "hi" in obs.a11y_tree
        reward = await sb.evaluate(parse_action("DONE"))
        await sb.close()
        await sb.close()
        await be.aclose()
        return reward, be

    reward, be = asyncio.run(main())
    assert reward == 1.0
    calls = fake_upstream.calls
    assert _names(calls) == ["init", "reset", "step", "step", "evaluate", "close"]
    init_kw = calls[0][1]
    assert init_kw["provider_name"] == "docker" and init_kw["action_space"] == "pyautogui"
    assert init_kw["screen_size"] == (1920, 1080) and init_kw["headless"] is True
    assert calls[1][1] == task_config_dict(word_task("hi"))["id"]
    assert calls[2][1:] == ("pyautogui.typewrite('hi')", 0.0)
    assert calls[3][1:] == ("DONE", 0)  # the terminal action reaches upstream's history
    assert be.inventory() == [] and be.metrics.closes == 1


def test_fork_is_n_fresh_resets_and_metrics_say_so(fake_upstream):
    async def main():
        be = OSWorldBackend(OSWorldBackendConfig(step_pause_s=0.0))
        env = AgentEnv(be, AgentEnvConfig(max_turns=2))
        results = await env.run_group(
            word_task("yo"),
            range(3),
            lambda o: _Scripted([TYPE.format("yo" if o != 1 else "no")]),
        )
        await be.aclose()
        return results, be

    results, be = asyncio.run(main())
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    names = _names(fake_upstream.calls)
    assert names.count("init") == 4 and names.count("reset") == 4  # base + 3 fresh resets
    assert names.count("close") == 4
    assert be.metrics.as_dict()["sandbox/forks_by_reset"] == 3
    assert be.metrics.as_dict()["sandbox/forks_by_snapshot"] == 0
    assert be.inventory() == []


def test_fail_answer_is_stepped_so_upstream_scores_it(fake_upstream):
    async def main():
        be = OSWorldBackend(OSWorldBackendConfig(step_pause_s=0.0))
        sb = await be.create(word_task("hi"))
        await sb.step(parse_action(TYPE.format("hi")))
        reward = await sb.evaluate(parse_action("FAIL"))
        await be.aclose()
        return reward

    assert asyncio.run(main()) == 0.0
    assert ("evaluate", "FAIL") in fake_upstream.calls


def test_error_mapping(fake_upstream):
    async def main():
        be = OSWorldBackend(OSWorldBackendConfig(provider_name="broken"))
        with pytest.raises(SandboxCreateError, match="no VM for you"):
            await be.create(word_task("x"))
        be2 = OSWorldBackend(OSWorldBackendConfig(step_pause_s=0.0))
        sb = await be2.create(word_task("x"))
        with pytest.raises(SandboxStepError, match="VM went away"):
            await sb.step(parse_action(TYPE.format("CRASH")))
        sb2 = await be2.create(word_task("x"))
        await sb2.step(parse_action(TYPE.format("EVALBOOM")))
        with pytest.raises(SandboxEvalError, match="getter exploded"):
            await sb2.evaluate(parse_action("DONE"))
        assert len(be2.inventory()) == 2
        await be2.aclose()  # closes what the owners left open
        assert be2.inventory() == []

    asyncio.run(main())


def test_agent_env_masks_failing_owner(fake_upstream):
    async def main():
        be = OSWorldBackend(OSWorldBackendConfig(step_pause_s=0.0))
        env = AgentEnv(be, AgentEnvConfig(max_turns=2))
        res = await env.run_group(
            word_task("ok"),
            range(3),
            lambda o: _Scripted([TYPE.format("CRASH" if o == 0 else "ok")]),
        )
        await be.aclose()
        return res, be

    res, be = asyncio.run(main())
    assert [r.failed for r in res] == [True, False, False]
    assert "SandboxStepError" in res[0].error and [r.reward for r in res[1:]] == [1.0, 1.0]
    assert be.inventory() == []


def test_cancelled_create_closes_the_env(fake_upstream):
    fake_upstream.reset_delay_s = 0.3

    async def main():
        be = OSWorldBackend(OSWorldBackendConfig())
        job = asyncio.ensure_future(be.create(word_task("x")))
        await asyncio.sleep(0.1)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        deadline = time.monotonic() + 5
        while "close" not in _names(fake_upstream.calls) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await be.aclose()
        return be

    be = asyncio.run(main())
    assert _names(fake_upstream.calls) == ["init", "reset", "close"]
    assert be.inventory() == []


def test_preflight_without_desktop_env(monkeypatch):
    monkeypatch.setitem(sys.modules, "desktop_env", None)  # import fails
    monkeypatch.setitem(sys.modules, "desktop_env.desktop_env", None)
    with pytest.raises(
        PreflightError, match="desktop_env is not installed.*osworld_jax\\[osworld\\]"
    ):
        OSWorldBackend().preflight()


def test_preflight_missing_vm_path(fake_upstream, tmp_path):
    cfg = OSWorldBackendConfig(provider_name="vmware", path_to_vm=str(tmp_path / "no.vmx"))
    with pytest.raises(PreflightError, match="path_to_vm .*no.vmx does not exist"):
        OSWorldBackend(cfg).preflight()


def test_task_config_dict_round_trips_for_dict_tasks():
    from osworld_jax.env.tasks import load_task

    task = word_task("abc")
    again = load_task(task_config_dict(task))
    assert again.config == task.config and again.evaluator == task.evaluator


class _Scripted:
    def __init__(self, replies):
        self.replies = list(replies)

    async def act(self, obs):
        return self.replies.pop(0) if self.replies else "DONE"


HAVE_UPSTREAM = importlib.util.find_spec("desktop_env") is not None


@pytest.mark.skipif(
    not HAVE_UPSTREAM,
    reason="upstream OSWorld desktop_env is not installed (pip install 'osworld_jax[osworld]')",
)
def test_real_desktop_env_signature_and_preflight():
    """With the real package: our kwargs and calls match its DesktopEnv; preflight passes."""
    from desktop_env.desktop_env import DesktopEnv

    OSWorldBackend().preflight()
    params = inspect.signature(DesktopEnv.__init__).parameters
    for name in OSWorldBackendConfig().env_kwargs():
        assert name in params, f"DesktopEnv has no parameter {name!r}"
    assert "task_config" in inspect.signature(DesktopEnv.reset).parameters
    assert "pause" in inspect.signature(DesktopEnv.step).parameters
    if not os.environ.get("OSWORLD_JAX_OSWORLD_PROVIDER"):
        pytest.skip("set OSWORLD_JAX_OSWORLD_PROVIDER (e.g. docker) to boot a real OSWorld VM")

    async def main():
        be = OSWorldBackend(
            OSWorldBackendConfig(provider_name=os.environ["OSWORLD_JAX_OSWORLD_PROVIDER"])
        )
        try:
            from osworld_jax.env.bundled import bundled_task_dir
            from osworld_jax.env.tasks import load_task

            task = load_task(bundled_task_dir() / "os" / "os-create-hello-file.json")
            sb = await be.create(task)
            obs = await sb.observe()
            assert obs.screenshot and obs.screenshot.startswith(b"\x89PNG")
            await sb.close()
        finally:
            await be.aclose()
        assert be.inventory() == []

    asyncio.run(main())

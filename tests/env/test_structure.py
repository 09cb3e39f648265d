"""The env room's shape: no import cycles, a leaf task format, backends found through one table."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import osworld_jax
from osworld_jax.env import BACKENDS, make_backend
from osworld_jax.env.backend import Sandbox, SandboxCreateError
from osworld_jax.env.backends import BUILTIN_BACKENDS, BackendRegistry
from osworld_jax.env.local import LocalBackend, LocalBackendConfig
from osworld_jax.env.osworld_adapter import OSWorldBackend, OSWorldBackendConfig
from osworld_jax.env.remote import RemoteBackend, RemoteBackendConfig
from osworld_jax.errors import ConfigError
from osworld_jax.testing.memory import MemoryBackend, word_task

REPO = Path(osworld_jax.__file__).resolve().parents[1]


def _import_cycles():
    spec = importlib.util.spec_from_file_location(
        "import_cycles", REPO / "scripts/import_cycles.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_env_has_no_import_cycle_and_no_deferred_import():
    ic = _import_cycles()
    edges = ic.graph(REPO / "osworld_jax" / "env")
    assert ic.cycles(edges, deferred=True) == []
    deferred = sorted((a, b) for a, ts in edges.items() for b, d in ts.items() if d)
    assert deferred == []


def test_cycle_finder_sees_deferred_and_lazy_imports(tmp_path):
    # The finder itself: a package whose circle closes only through a function-level import and
    # an importlib string (the shape env/ had) is reported over all edges, not module-level ones.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'import importlib\nLAZY = {"b": "pkg.b"}\n\n\n'
        "def load():\n    return importlib.import_module(LAZY['b'])\n"
    )
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    import pkg\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    ic = _import_cycles()
    edges = ic.graph(pkg)
    assert edges["pkg.a"] == {"pkg.b": False}
    assert edges["pkg.c"] == {}  # TYPE_CHECKING imports never run
    assert ic.cycles(edges, deferred=False) == []
    assert ic.cycles(edges, deferred=True) == [["pkg", "pkg.b"]]


def test_task_format_is_a_leaf():
    edges = _import_cycles().graph(REPO / "osworld_jax" / "env")
    assert edges["osworld_jax.env.tasks"] == {}


def test_builtin_backends_resolve_to_their_classes():
    assert set(BUILTIN_BACKENDS) == {"local", "remote", "osworld", "memory"}
    assert BACKENDS.get("local") is LocalBackend
    assert BACKENDS.get("remote") is RemoteBackend
    assert BACKENDS.get("osworld") is OSWorldBackend
    assert BACKENDS.get("memory") is MemoryBackend
    assert set(BACKENDS.config_classes()) == {
        LocalBackendConfig,
        RemoteBackendConfig,
        OSWorldBackendConfig,
    }
    for name in BUILTIN_BACKENDS:
        cls = BACKENDS.get(name)
        assert cls.name == name and issubclass(cls.sandbox_type, Sandbox)
    assert [n for n in BUILTIN_BACKENDS if BACKENDS.get(n).runs_on_host] == ["local"]


def test_make_backend_by_config_and_by_name():
    local = make_backend(LocalBackendConfig(screen_width=800))
    assert isinstance(local, LocalBackend) and local.config.screen_width == 800
    osw = make_backend(OSWorldBackendConfig(provider_name="docker"))
    assert isinstance(osw, OSWorldBackend) and osw.config.provider_name == "docker"
    mem = make_backend("memory", screenshot_px=8)
    assert isinstance(mem, MemoryBackend) and mem.screenshot_px == 8
    with pytest.raises(ConfigError, match="no sandbox backend takes a dict"):
        make_backend({"screen_width": 1})
    with pytest.raises(ConfigError, match="unknown sandbox backend 'nope'.*'local'"):
        make_backend("nope")
    with pytest.raises(TypeError, match="no further arguments"):
        make_backend(LocalBackendConfig(), 1)


def test_registry_refuses_a_taken_name():
    with pytest.raises(ValueError, match="duplicate sandbox backend name 'local'"):
        BACKENDS.add("local", MemoryBackend)


def test_a_new_backend_is_one_module_and_one_registry_line(tmp_path, monkeypatch):
    """The DESIGN.md recipe, done: a module with a backend and its config, one table line."""
    (tmp_path / "acme_backend.py").write_text(
        """
import dataclasses
from osworld_jax.env.backend import Sandbox, SandboxBackend


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcmeConfig:
    size: int = 1


class AcmeSandbox(Sandbox):
    pass


class AcmeBackend(SandboxBackend[AcmeSandbox]):
    name = "acme"
    sandbox_type = AcmeSandbox
    config_class = AcmeConfig

    def __init__(self, config):
        self.config = config

    def preflight(self):
        pass

    async def create(self, task):
        raise NotImplementedError

    async def _fork(self, sandbox, n):
        raise NotImplementedError

    def inventory(self):
        return []
"""
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = BackendRegistry("sandbox backend", {"acme": "acme_backend:AcmeBackend"})
    assert "acme" in registry and "acme_backend" not in sys.modules  # imported on first use
    cls = registry.get("acme")
    config_cls = sys.modules["acme_backend"].AcmeConfig
    assert registry.config_classes() == (config_cls,)
    assert registry.name_for_config(config_cls(size=3)) == "acme"
    assert cls(config_cls(size=3)).config.size == 3
    # a table line naming a class whose name differs fails loudly at first use
    wrong = BackendRegistry("sandbox backend", {"other": "acme_backend:AcmeBackend"})
    with pytest.raises(TypeError, match="not a SandboxBackend named 'other'"):
        wrong.get("other")


def test_fork_validates_once_for_every_backend():
    async def main():
        be = MemoryBackend()
        sb = await be.create(word_task("x"))
        with pytest.raises(ValueError, match="n must be >= 0"):
            await be.fork(sb, -1)
        assert await be.fork(sb, 0) == []
        other = MemoryBackend()
        with pytest.raises(SandboxCreateError, match="is not live here"):
            await other.fork(sb, 1)
        await sb.close()
        with pytest.raises(SandboxCreateError, match="is not live here"):
            await be.fork(sb, 1)

    asyncio.run(main())


def test_every_env_module_imports_first():
    """Each env module can be the first one a process imports (no order-dependent circle
    through a package ``__init__``, which the static cycle count does not see).
    """  # noqa: D205
    root = REPO / "osworld_jax"
    mods = []
    for p in sorted([*(root / "env").rglob("*.py"), *(root / "testing").rglob("*.py")]):
        if "shim" in p.parts or p.name == "__main__.py":
            continue
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        mods.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    code = (
        "import importlib, sys\n"
        "bad = []\n"
        f"for m in {mods!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('osworld_jax')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {e!r}')\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert len(mods) > 30 and out.stdout.strip() == "", out.stdout


def test_the_env_and_agent_rooms_import_no_jax():
    """Rooms rule: no jax in ``env/`` or ``agent/``. Every module of both rooms is imported in a
    fresh interpreter; neither jax nor torch may be loaded by any of them."""
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for room in ("env", "agent")
        for p in (REPO / "osworld_jax" / room).rglob("*.py")
        if "shim" not in p.parts and p.stem not in ("__main__", "vmserver")
    )
    assert len(modules) > 30, modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "    assert 'jax' not in sys.modules, f'{m} imported jax'\n"
        "    assert 'torch' not in sys.modules, f'{m} imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

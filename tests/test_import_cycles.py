"""The package's rooms: no import circle in ``osworld_jax`` or ``benchmarks``, imports one way.

Static (``scripts/import_cycles.py`` reads the sources; nothing is imported), so cheap.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import osworld_jax

REPO = Path(osworld_jax.__file__).resolve().parents[1]


@functools.cache
def _ic():
    path = REPO / "scripts" / "import_cycles.py"
    spec = importlib.util.spec_from_file_location("import_cycles", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _graph():
    # TYPE_CHECKING imports count too: a reader goes round a type-only circle all the same.
    return _ic().graph(REPO / "osworld_jax", REPO / "benchmarks", typing=True)


def test_no_import_circle_in_the_package_and_benchmarks(capsys):
    ic = _ic()
    rc = ic.main(["--fail", "--typing", str(REPO / "osworld_jax"), str(REPO / "benchmarks")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "cycles over all imports: 0" in out
    edges = _graph()
    assert "train_step" in edges and "osworld_jax.server.engine" in edges  # both dirs scanned
    assert ic.cycles(edges, deferred=True) == []


def test_the_client_room_never_imports_the_server_room():
    edges = _graph()
    assert len([m for m in edges if m.startswith("osworld_jax.rollout.")]) >= 4
    assert _ic().forbidden(edges, "osworld_jax.rollout", "osworld_jax.server") == []
    # nor do the rooms that use the client (the agent, the RL loop, the trainer)
    for room in ("agent", "trainer", "env", "algorithms", "data", "model", "contract"):
        assert _ic().forbidden(edges, f"osworld_jax.{room}", "osworld_jax.server") == [], room
    # the RL loop starts the in-process server through its one face, nothing else of the room
    used = {b for _, b in _ic().forbidden(edges, "osworld_jax.rl", "osworld_jax.server")}
    assert used <= {"osworld_jax.server.colocated"}, used


def test_the_contract_room_is_the_bottom_both_sides_share():
    edges = _graph()
    assert len([m for m in edges if m.startswith("osworld_jax.contract.")]) >= 4
    for room in ("rollout", "server", "rl", "trainer", "model", "agent", "env"):
        assert _ic().forbidden(edges, "osworld_jax.contract", f"osworld_jax.{room}") == [], room


def test_the_server_room_never_imports_the_agent_room():
    edges = _graph()
    assert len([m for m in edges if m.startswith("osworld_jax.server.")]) >= 15
    assert _ic().forbidden(edges, "osworld_jax.server", "osworld_jax.agent") == []
    # nor the client room: what both sides share is the contract room
    assert _ic().forbidden(edges, "osworld_jax.server", "osworld_jax.rollout") == []
    assert any(b.startswith("osworld_jax.contract") for b in edges["osworld_jax.server.engine"])
    # the chat template both use lives in the model room
    assert "osworld_jax.model.chat_template" in edges["osworld_jax.server.openai_api"]
    assert _ic().forbidden(edges, "osworld_jax.model", "osworld_jax.agent") == []


def test_finder_reads_script_folders_type_only_imports_and_forbidden_edges(tmp_path, capsys):
    # Scripts that import each other by bare name (the benchmarks' shape), a circle closed only
    # by a TYPE_CHECKING import, and a forbidden edge between two rooms of a package.
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "a.py").write_text("def f():\n    from b import x\n")
    (bench / "b.py").write_text("from a import f\n")
    pkg = tmp_path / "pkg"
    (pkg / "client").mkdir(parents=True)
    (pkg / "server").mkdir()
    for d in (pkg, pkg / "client", pkg / "server"):
        (d / "__init__.py").write_text("")
    (pkg / "client" / "c.py").write_text("from pkg.server import s\n")
    (pkg / "server" / "s.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.server.t import T\n"
    )
    (pkg / "server" / "t.py").write_text("from pkg.server.s import s_fn\n")
    ic = _ic()
    edges = ic.graph(bench, pkg)
    assert edges["a"] == {"b": True} and edges["b"] == {"a": False}
    assert ic.cycles(edges, deferred=True) == [["a", "b"]]
    assert ic.cycles(edges, deferred=False) == []
    assert edges["pkg.server.s"] == {}  # TYPE_CHECKING ignored by default
    typed = ic.graph(bench, pkg, typing=True)
    assert ["pkg.server.s", "pkg.server.t"] in ic.cycles(typed, deferred=True)
    assert ic.forbidden(edges, "pkg.client", "pkg.server") == [("pkg.client.c", "pkg.server.s")]
    rc = ic.main(["--fail", str(pkg), "--forbid", "pkg.client=pkg.server"])
    out = capsys.readouterr().out
    assert rc == 1 and "pkg.client.c -> pkg.server.s" in out
    assert ic.main([str(pkg)]) == 0  # without --fail it only reports


def test_the_client_room_and_the_server_images_module_import_no_jax():
    """The client side and ``osworld_jax.server.images`` stay jax-free (``server/__init__`` is
    empty), so the agent and env rooms may use them."""  # noqa: D205, D209
    code = (
        "import sys, osworld_jax.rollout, osworld_jax.rollout.launch, osworld_jax.server.images\n"
        "assert 'jax' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

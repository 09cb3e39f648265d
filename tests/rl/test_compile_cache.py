"""The persistent compilation cache (rl/compile_cache.py, rl/servers.py) on a real jax cache.

A "next process" is simulated in this one: ``jax.clear_caches()`` drops the in-memory
executables and ``compilation_cache.reset_cache()`` makes jax open the directory afresh, as a
new process does (a subprocess would pay jax's import again for the same code path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_cache

from osworld_jax.errors import ConfigError
from osworld_jax.rl import compile_cache
from osworld_jax.rl.config import ExperimentConfig, RLConfig
from osworld_jax.rl.servers import CACHE_ENV, compilation_cache_problem, use_compilation_cache

_SETTINGS = {
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


@pytest.fixture
def real_cache(tmp_path):
    """jax writing every compile into ``tmp_path/cache``; the settings restored afterwards."""
    before = {k: getattr(jax.config, k) for k in _SETTINGS}
    for k, v in {**_SETTINGS, "jax_compilation_cache_dir": str(tmp_path / "cache")}.items():
        jax.config.update(k, v)
    jax_cache.reset_cache()
    yield tmp_path / "cache"
    for k, v in before.items():
        jax.config.update(k, v)
    jax_cache.reset_cache()
    jax.clear_caches()


def _next_process() -> None:
    jax.clear_caches()
    jax_cache.reset_cache()


def _run_once(events: list[str]) -> list[str]:
    del events[:]

    @jax.jit
    def f(x):
        return jnp.sin(x) * 3.0 + jnp.cumsum(x)

    f(np.arange(7.0, dtype=np.float32)).block_until_ready()  # numpy: f is the only compile
    return [e for e in events if e.startswith("/jax/compilation_cache/cache_")]


def test_a_truncated_entry_is_removed_then_rewritten_and_hit(real_cache):
    events: list[str] = []

    def listen(name: str, **kw: object) -> None:
        events.append(name)

    jax.monitoring.register_event_listener(listen)
    try:
        _truncate_rewrite_hit(real_cache, events)
    finally:
        jax._src.monitoring.unregister_event_listener(listen)


def _truncate_rewrite_hit(real_cache, events: list[str]) -> None:
    assert _run_once(events) == ["/jax/compilation_cache/cache_misses"]
    [entry] = real_cache.glob(f"*{compile_cache.ENTRY_SUFFIX}")
    whole = entry.read_bytes()
    assert compile_cache.repair(real_cache, settle_s=0) == []  # a whole entry stays
    entry.write_bytes(whole[: len(whole) // 2])  # a writer killed mid-write

    _next_process()  # without the repair: jax fails to read it, recompiles, keeps the stub
    with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry"):
        assert "cache_hits" not in " ".join(_run_once(events))
    assert entry.stat().st_size == len(whole) // 2

    _next_process()  # the start's repair removes it; the compile writes it again
    assert compile_cache.repair(real_cache, settle_s=0) == [f"{entry.name} (truncated)"]
    assert not entry.exists()
    assert _run_once(events) == ["/jax/compilation_cache/cache_misses"]
    assert compile_cache.entry_problem(entry) is None  # whole again (its compile time differs)
    assert entry.stat().st_size > len(whole) // 2

    _next_process()  # the next process hits it
    assert _run_once(events) == ["/jax/compilation_cache/cache_hits"]


def test_an_unusable_cache_dir_is_one_config_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    (tmp_path / "file").write_text("")
    bad = ExperimentConfig(rl=RLConfig(compilation_cache_dir=str(tmp_path / "file" / "jax")))
    line = compilation_cache_problem(bad)
    assert line == (
        f"RLConfig.compilation_cache_dir = '{tmp_path}/file/jax' cannot be created: "
        f"{tmp_path}/file is a file"
    )
    with pytest.raises(ConfigError, match=r"^RLConfig.compilation_cache_dir = .* is a file$"):
        use_compilation_cache(bad)
    good = ExperimentConfig(rl=RLConfig(compilation_cache_dir=str(tmp_path / "new" / "jax")))
    assert compilation_cache_problem(good) is None and not (tmp_path / "new").exists()


def test_each_steps_metrics_count_the_programs_it_compiled_or_loaded(real_cache):
    """`metrics_step.compile_metrics`: a compile, then (next process) a load from the cache."""
    from osworld_jax.rl import metrics_step

    metrics_step.start_compile_counts()
    _run_once([])
    first = metrics_step.compile_metrics()
    assert first["compile/programs"] == 1 and first["compile/cache_hits"] == 0
    assert first["compile/seconds"] > 0 and first["compile/trace_lower_seconds"] > 0
    assert metrics_step.compile_metrics()["compile/programs"] == 0  # nothing since
    _next_process()
    _run_once([])
    second = metrics_step.compile_metrics()
    assert second["compile/programs"] == 1 and second["compile/cache_hits"] == 1
    metrics_step.start_compile_counts()  # again: one set of listeners, counts from zero
    assert metrics_step.compile_metrics()["compile/programs"] == 0
    assert len(metrics_step._COMPILES) == 1

"""Trainer tests compile the same train step in several tests (identical HLO): share XLA
executables through a per-session persistent compilation cache, switched on only while the
tests of this directory run."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache


@pytest.fixture(scope="session")
def _compile_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(autouse=True, scope="module")
def _compile_cache(_compile_cache_dir):
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", _compile_cache_dir)
    compilation_cache.reset_cache()  # re-read the directory (the cache state is per process)
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()

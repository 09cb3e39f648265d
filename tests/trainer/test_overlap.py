"""The overlap presets (`trainer.overlap`): every flag exists in this jaxlib; merge and timing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from osworld_jax.errors import ConfigError
from osworld_jax.trainer.overlap import (
    OVERLAP_PRESETS,
    apply_overlap,
    merged_xla_flags,
    overlap_flags,
)

_RUN = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x * 2)(jnp.ones(()))))"


def _run_with(flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=120
    )


def test_every_preset_flag_is_known_to_this_xla():
    # XLA aborts on an unknown flag name ("Unknown flag in XLA_FLAGS"): one process with every
    # flag of every preset, and the control that a misspelt one does abort.
    flags = sorted({f for preset in OVERLAP_PRESETS.values() for f in preset})
    ok = _run_with(" ".join(flags))
    assert ok.returncode == 0 and ok.stdout.strip() == "2.0", ok.stderr[-2000:]
    bad = _run_with("--xla_gpu_enable_pipelined_all_gathers=true")
    assert bad.returncode != 0 and "Unknown flag" in bad.stderr


def test_presets_are_layered_and_unknown_names_fail():
    assert overlap_flags("none") == ()
    pipelined = set(overlap_flags("pipelined"))
    assert "--xla_gpu_enable_pipelined_all_gather=true" in pipelined
    assert pipelined < set(overlap_flags("collective_matmul"))
    # Seen changing the step's result with jax 0.11.2 on 2 H200s (benchmarks/NOTES.md):
    assert not any("double_buffering" in f for p in OVERLAP_PRESETS.values() for f in p)
    with pytest.raises(ConfigError, match="overlap preset 'fast'"):
        overlap_flags("fast")


def test_flags_the_user_set_win_and_others_are_added():
    user = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_pipelined_all_gather=false"
    env = {"XLA_FLAGS": user}
    merged = apply_overlap("pipelined", env)
    assert env["XLA_FLAGS"] == merged
    words = merged.split()
    assert words[:2] == user.split()  # kept, in order, with the user's value
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in words
    assert "--xla_gpu_enable_pipelined_all_reduce=true" in words
    assert merged_xla_flags(merged, overlap_flags("pipelined")) == merged  # idempotent
    assert apply_overlap("none", {}) == ""


def test_applying_after_the_backend_started_raises():
    import jax

    jax.devices()  # this test process's backend is up (conftest's 8 CPU devices)
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(ConfigError, match="already started"):
        apply_overlap("pipelined")
    assert os.environ.get("XLA_FLAGS") == before

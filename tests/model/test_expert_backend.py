"""``expert_backend='auto'`` picks per platform and device kind; ``ragged`` on a GPU warns once.

The platform and the device kind are monkeypatched (``jax.default_backend``, ``jax.devices``):
the selection is plain Python run when the layer is traced, so every platform is checked on
the CPU.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

from osworld_jax.model import moe


class _FakeGpu:
    def __init__(self, compute_capability: str) -> None:
        self.compute_capability = compute_capability
        self.platform = "gpu"


def _on(monkeypatch, platform: str, capability: str | None = None) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    if capability is not None:
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeGpu(capability)])


@pytest.mark.parametrize(
    ("platform", "capability", "dtype", "expected"),
    [
        ("gpu", "9.0", jnp.bfloat16, "pallas_gmm_mosaic"),  # H100 / H200: Mosaic (TMA + wgmma)
        ("cuda", "9.0", jnp.float16, "pallas_gmm_mosaic"),
        ("gpu", "9.0", jnp.float32, "pallas_gmm"),  # the Mosaic kernels are 16-bit only
        ("gpu", "8.0", jnp.bfloat16, "pallas_gmm"),  # A100: Triton
        ("gpu", "10.0", jnp.bfloat16, "pallas_gmm"),  # Blackwell: no Hopper wgmma
        ("rocm", "9.0", jnp.bfloat16, "pallas_gmm"),  # AMD "9.x" is not Hopper
        ("tpu", None, jnp.bfloat16, "ragged"),  # ragged_dot lowers to the TPU grouped matmul
        ("cpu", None, jnp.float32, "ragged"),
    ],
)
def test_auto_resolves_per_platform_and_device_kind(
    monkeypatch, platform, capability, dtype, expected
):
    _on(monkeypatch, platform, capability)
    assert moe.auto_expert_backend(dtype) == expected  # detected
    assert moe.auto_expert_backend(dtype, platform) == expected  # given
    assert expected in moe.EXPERT_BACKENDS


@pytest.mark.parametrize(
    ("platform", "capability"), [("gpu", "9.0"), ("gpu", "8.6"), ("cpu", None)]
)
def test_auto_backend_calls_the_resolved_backend(monkeypatch, platform, capability):
    _on(monkeypatch, platform, capability)
    expected = moe.auto_expert_backend(jnp.bfloat16)
    calls = []
    for name in ("pallas_gmm_mosaic", "pallas_gmm", "ragged"):
        spy = lambda *args, name=name: calls.append(name) or args[0]  # noqa: E731
        monkeypatch.setitem(moe.EXPERT_BACKENDS._items, name, spy)
    x = jnp.ones((4, 8), jnp.bfloat16)
    experts = jnp.zeros((4, 2), jnp.int32)
    weights = jnp.ones((4, 2), jnp.float32)
    w = jnp.ones((3, 8, 8), jnp.bfloat16)
    out = moe.EXPERT_BACKENDS.get("auto")(x, experts, weights, w, w, w)
    assert calls == [expected] and out is x


def _ragged_inputs():
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (6, 8))
    experts = jax.random.randint(ks[1], (6, 2), 0, 3)
    weights = jax.nn.softmax(jax.random.normal(ks[2], (6, 2)))
    w = jax.random.normal(ks[3], (3, 8, 8)) / 3
    return x, experts, weights, w, w, w


def test_ragged_on_a_gpu_warns_once_naming_auto(monkeypatch):
    monkeypatch.setattr(moe, "_RAGGED_GPU_WARNED", False)
    args = _ragged_inputs()
    ref = moe.ragged_experts(*args)  # on the CPU: no warning
    _on(monkeypatch, "gpu")
    with pytest.warns(RuntimeWarning, match="expert_backend='auto'") as record:
        got = moe.ragged_experts(*args)
    assert len(record) == 1 and "dense masked matmul" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        moe.ragged_experts(*args)
        moe.EXPERT_BACKENDS.get("ragged")(*args)
    assert jnp.array_equal(got, ref)  # the warning changes nothing else


def test_ragged_off_a_gpu_never_warns(monkeypatch):
    monkeypatch.setattr(moe, "_RAGGED_GPU_WARNED", False)
    for platform in ("cpu", "tpu"):
        _on(monkeypatch, platform)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            moe.ragged_experts(*_ragged_inputs())
    assert moe._RAGGED_GPU_WARNED is False

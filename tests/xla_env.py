"""The XLA flags of a test's worker process (imports nothing heavy: call it before jax)."""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def use_host_devices(n: int) -> None:
    """Sets ``n`` CPU devices in ``XLA_FLAGS``, keeping the suite's other flags (tests/conftest.py:
    the -O0 compiles, so a worker reuses the suite's compilation cache and compile speed)."""  # noqa: D205, D209
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT}={n}"])

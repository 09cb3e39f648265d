"""Test set-up: 8 CPU devices for sharding tests, and the --runslow switch for slow tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", default=False, help="also run tests marked slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _apps_missing(names: tuple[str, ...]) -> list[str]:
    from osworld_jax.env.local import apps

    return [a.name for a in apps.APPS if a.name in names and not apps.installed(a)]


@pytest.fixture(scope="session")
def real_apps():
    """One jailed desktop whose real applications make test files (``RealApps``), per session.

    Skips without LibreOffice, Chromium, GIMP, VLC and Thunderbird (``bash scripts/setup.sh
    --apps``); with ``OSWORLD_JAX_REQUIRE_APPS=1`` (CI's ``scripts/test.sh``) that is a failure.
    """
    missing = _apps_missing(("libreoffice", "chrome", "gimp", "vlc", "thunderbird"))
    if missing:
        why = f"not installed: {', '.join(missing)} (bash scripts/setup.sh --apps)"
        if os.environ.get("OSWORLD_JAX_REQUIRE_APPS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    from osworld_jax.testing.apps import RealApps

    apps = RealApps()
    yield apps
    apps.close()

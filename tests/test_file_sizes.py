"""Files a reader can hold: no module of the package is over 600 lines.

The exceptions are the programs that run inside the jail (``env/local/vmserver.py`` and the
``env/local/shim/`` stand-ins for upstream's pyautogui and friends): each is copied into the
sandbox as one self-contained file, so it cannot be split into the package's modules.
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "osworld_jax"
LIMIT = 600
IN_JAIL = {"env/local/vmserver.py"}


def _in_jail(rel: str) -> bool:
    return rel in IN_JAIL or rel.startswith("env/local/shim/")


def test_no_package_file_over_600_lines():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        n = len(path.read_text().splitlines())
        if n > LIMIT and not _in_jail(rel):
            long[rel] = n
    assert not long, f"over {LIMIT} lines (split along what each does): {long}"


def test_the_in_jail_exceptions_exist():
    # An exception naming a file that is gone would silently allow a new long file there.
    assert (PACKAGE / "env/local/vmserver.py").is_file()
    assert any((PACKAGE / "env/local/shim").glob("*.py"))

"""RealApps.office restarts a stuck or vanished LibreOffice and tries once more (no desktop)."""

from __future__ import annotations

import pytest

from osworld_jax.testing.apps import WORK, RealAppError, RealApps


class _Desktop:
    def log_tail(self, n: int) -> str:
        return "jail log"


class _Scripted(RealApps):
    """RealApps whose desktop answers conversions from a script of results."""

    def __init__(self, conversions: list[dict]) -> None:
        super().__init__()
        self.conversions, self.launched, self.warm_ups = conversions, [], 0

    @property
    def desktop(self):  # type: ignore[override]
        return _Desktop()

    def execute(self, command, *, shell=False):
        if command[:2] == ["python3", f"{WORK}/lo_convert.py"]:
            if command[2].endswith("/warm-up.csv"):  # soffice's hidden first load
                self.warm_ups += 1
                return {"status": "error", "output": "", "error": "", "returncode": 124}
            return self.conversions.pop(0)
        return {"status": "success", "output": "", "error": "", "returncode": 0}

    def launch(self, command, *, shell=False):
        self.launched.append(command[0])

    def upload(self, path, data):
        pass

    def file(self, path):
        return b"converted " + path.encode()


@pytest.fixture
def scripted():
    """Makes `_Scripted` apps; closes them after the test."""
    made: list[_Scripted] = []

    def make(conversions: list[dict]) -> _Scripted:
        made.append(_Scripted(conversions))
        return made[-1]

    yield make
    for apps in made:
        apps.close()


OK = {"status": "success", "output": "", "error": "", "returncode": 0}
TIMED_OUT = {
    "status": "error",
    "output": "",
    "error": "command timed out after 120 s",
    "returncode": -9,
}


@pytest.mark.parametrize(
    "first",
    [
        TIMED_OUT,  # /execute's time limit
        {"status": "error", "output": "", "error": "", "returncode": 124},  # timeout(1)
        {"status": "error", "output": "", "error": "", "returncode": 142},  # SIGALRM, as a shell
        {"status": "error", "output": "", "error": "NoConnectException", "returncode": 1},
    ],
)
def test_a_stuck_or_gone_office_is_restarted_and_the_document_tried_once_more(first, scripted):
    apps = scripted([first, OK])
    # (path 1 is the warm-up's)
    assert apps.office(b"x", "a.xlsx", "xlsx") == f"converted {WORK}/2/out/a.xlsx".encode()
    assert apps.launched == ["soffice", "pkill", "soffice"]
    assert apps.conversions == []
    assert apps.warm_ups == 2  # one per start; a failed warm-up is not the document's failure


def test_a_document_that_blocks_office_twice_fails_naming_it_and_the_log(scripted):
    apps = scripted([TIMED_OUT, TIMED_OUT])
    with pytest.raises(RealAppError, match=r"LibreOffice a\.xlsx -> xlsx failed .*jail log"):
        apps.office(b"x", "a.xlsx", "xlsx")


def test_other_failures_are_not_retried(scripted):
    apps = scripted([{"status": "error", "output": "", "error": "could not load", "returncode": 1}])
    with pytest.raises(RealAppError, match="could not load"):
        apps.office(b"x", "a.xlsx", "xlsx")
    assert apps.launched == ["soffice"]

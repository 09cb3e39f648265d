"""General getters, setup-step fidelity and evaluate_task on real task shapes (a HostVM desktop)."""

import asyncio
import datetime as dt
import hashlib
import logging

import pytest

from osworld_jax.env.actions import parse_action
from osworld_jax.env.evaluators import GETTERS, evaluate_task
from osworld_jax.env.evaluators.registry import EvalContext
from osworld_jax.env.evaluators.relative_time import fill_time_template, resolve_relative_time
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tasks import SetupStep, load_task
from tests.env.evaluators.hostvm import HostVM

DONE = parse_action("DONE")


def run(coro):
    return asyncio.run(coro)


async def no_sleep(_):
    return None


@pytest.fixture
def vm(tmp_path):
    return HostVM(tmp_path / "home")


@pytest.fixture
def ctx(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    return EvalContext(work_dir=work)


def test_list_directory_is_upstreams_tree(vm, ctx):
    (vm.home / "Desktop" / "cpjpg" / "sub").mkdir(parents=True)
    (vm.home / "Desktop" / "cpjpg" / "a.jpg").write_bytes(b"")
    (vm.home / "Desktop" / "cpjpg" / "sub" / "b.jpg").write_bytes(b"")
    tree = run(GETTERS.get("list_directory")(vm, {"path": "/home/user/Desktop/cpjpg"}, ctx))
    assert tree["type"] == "directory" and tree["name"] == "cpjpg"
    kids = {c["name"]: c for c in tree["children"]}
    assert kids["a.jpg"] == {"type": "file", "name": "a.jpg"}
    assert kids["sub"] == {
        "type": "directory",
        "name": "sub",
        "children": [{"type": "file", "name": "b.jpg"}],
    }
    assert run(GETTERS.get("list_directory")(vm, {"path": "/home/user/nope"}, ctx)) is None


def test_content_from_vm_file_last_row(vm, ctx, src):
    book = src.xlsx("r.xlsx", {"Sheet1": [["name", "cites"], ["A", 1], ["Yann LeCun", 345074]]})
    vm.local("/home/user/Desktop/researchers.xlsx").parent.mkdir(parents=True)
    vm.local("/home/user/Desktop/researchers.xlsx").write_bytes(open(book, "rb").read())
    g = GETTERS.get("content_from_vm_file")
    params = {
        "path": "/home/user/Desktop/researchers.xlsx",
        "file_type": "xlsx",
        "file_content": "last_row",
    }
    assert run(g(vm, params, ctx)) == ["Yann LeCun", "345074"]
    with pytest.raises(FileNotFoundError):
        run(g(vm, {**params, "path": "/home/user/missing.xlsx"}, ctx))


def test_relative_time_templates():
    # 2024-03-06 is a Wednesday (weekday 2)
    now = dt.datetime(2024, 3, 6, 15, 30)
    assert fill_time_template(
        "{DoW} {Month} {DayD} {Year} {Month0D}/{Day0D} {month} {MonthFull} {MonthD}", now
    ) == ("Wed Mar 6 2024 03/06 march March 3")

    def one(name, template="{Year}-{Month0D}-{Day0D}"):
        rules = {"relativeTime": {"from": name}, "expected": {"time": template}}
        return resolve_relative_time(rules, now)["expected"]["time"]

    assert one("tomorrow") == "2024-03-07"
    assert one("next Monday") == "2024-03-11"  # 7 - 2 = 5 days on
    assert one("5th next month") == "2024-04-05"
    assert one("this month", "{MonthFull}") == "March"
    # first Monday 8 months later: November 2024 starts on a Friday -> Monday the 4th
    assert one("first monday eight months later") == "2024-11-04"
    # August + 4 months is December (upstream computes month 0 and crashes there)
    assert (
        resolve_relative_time(
            {
                "relativeTime": {"from": "first monday four months later"},
                "expected": {"time": "{Month0D}-{Day0D}"},
            },
            dt.datetime(2024, 8, 1),
        )["expected"]["time"]
        == "12-02"
    )
    span = resolve_relative_time(
        {
            "relativeTime": {"from": "next week Saturday", "to": "next week Sunday"},
            "expected": {"from": "{DayD}", "to": "{DayD}"},
        },
        now,
    )["expected"]
    assert span == {"from": "16", "to": "17"}  # Wed 6th -> Mon 11th -> Sat 16th, Sun 17th
    split = resolve_relative_time(
        {
            "relativeTime": {"from": "next Monday split", "to": "next Friday split"},
            "expected": {
                "puDay": "{DayD}",
                "puMonth": "{MonthD}",
                "puYear": "{Year}",
                "doDay": "{DayD}",
                "doMonth": "{MonthD}",
                "doYear": "{Year}",
            },
        },
        now,
    )["expected"]
    assert (split["puDay"], split["doDay"]) == ("11", "15")  # that Monday and its Friday
    lst = {"relativeTime": {"from": "tomorrow"}, "expected": {"time": ["{DayD}", "{Day0D}"]}}
    assert resolve_relative_time(lst, now)["expected"]["time"] == ["7", "07"]
    assert lst["expected"]["time"] == ["{DayD}", "{Day0D}"]  # the task's rules are not mutated


def test_rule_relative_time_uses_the_desktops_clock(vm, ctx):
    g = GETTERS.get("rule_relativeTime")
    rules = {"relativeTime": {"from": "tomorrow"}, "expected": {"time": "{Year}-{Month0D}-{Day0D}"}}
    got = run(g(vm, {"rules": rules}, ctx))["expected"]["time"]
    today = dt.datetime.now().astimezone()
    assert got in {(today + dt.timedelta(days=d)).strftime("%Y-%m-%d") for d in (1, 2)}
    zoned = run(g(vm, {"rules": {**rules, "timezone": "Pacific/Kiritimati"}}, ctx))
    kiri = dt.datetime.now(dt.timezone(dt.timedelta(hours=14))) + dt.timedelta(days=1)
    assert zoned["expected"]["time"] == kiri.strftime("%Y-%m-%d")


def _sheet_print_task(url_dir):
    stem = "Keep_Two_decimal_points"
    gold = [f"{url_dir}/{stem}_gold.xlsx", f"{url_dir}/{stem}_gold-Sheet1.csv"]
    window = f"{stem}.xlsx - LibreOffice Calc"
    return load_task(
        {
            "id": "t6e99a1ad",
            "instruction": "x",
            "evaluator": {
                "postconfig": [
                    {
                        "type": "activate_window",
                        "parameters": {"window_name": window, "strict": True},
                    },
                ],
                "func": "compare_table",
                "result": {
                    "type": "vm_file",
                    "multi": True,
                    "path": [f"/home/user/{stem}.xlsx", f"/home/user/{stem}-Sheet1.csv"],
                    "dest": [f"{stem}.xlsx", f"{stem}-Sheet1.csv"],
                },
                "expected": {
                    "type": "cloud_file",
                    "multi": True,
                    "path": gold,
                    "dest": [f"{stem}_gold.xlsx", f"{stem}_gold-Sheet1.csv"],
                },
                "options": {
                    "rules": [
                        {"type": "sheet_print", "sheet_idx0": "RNSheet1", "sheet_idx1": "ENSheet1"}
                    ]
                },
            },
        }
    )


def test_sheet_print_task_end_to_end_with_a_missing_window(vm, tmp_path, src, caplog):
    # Task 6e99a1ad's shape: multi getters without gives hand compare_table the xlsx path, and
    # sheet_print reads the CSV fetched beside it. The postconfig's activate_window gets a 404
    # (no such window): upstream logs it and scores, so do we.
    stem = "Keep_Two_decimal_points"
    url_dir = "https://host/files/calc"
    cache = tmp_path / "cache"
    cache.mkdir()
    gold = src.xlsx("gold/g.xlsx", {"Sheet1": [["v"], [1.5]]})
    for name, data in (
        (f"{stem}_gold.xlsx", open(gold, "rb").read()),
        (f"{stem}_gold-Sheet1.csv", b"v\n1.50\n"),
    ):
        (cache / hashlib.sha256(f"{url_dir}/{name}".encode()).hexdigest()).write_bytes(data)
    vm.local(f"/home/user/{stem}.xlsx").write_bytes(open(gold, "rb").read())
    vm.missing_windows.add(f"{stem}.xlsx - LibreOffice Calc")
    t = _sheet_print_task(url_dir)
    vm.local(f"/home/user/{stem}-Sheet1.csv").write_text("v\n1.50\n")
    with caplog.at_level(logging.WARNING):
        assert run(evaluate_task(t, vm, DONE, cache_dir=cache, sleep=no_sleep)) == 1.0
    assert "not found" in caplog.text and "ignored" in caplog.text
    vm.local(f"/home/user/{stem}-Sheet1.csv").write_text("v\n1.5\n")  # not two decimals
    assert run(evaluate_task(t, vm, DONE, cache_dir=cache, sleep=no_sleep)) == 0.0


def test_missing_result_file_scores_zero_not_an_error(vm):
    # upstream: FileNotFoundError from the result getter scores the task 0
    t = load_task(
        {
            "id": "t",
            "instruction": "x",
            "evaluator": {
                "func": "literal_match",
                "result": {
                    "type": "content_from_vm_file",
                    "path": "/home/user/none.xlsx",
                    "file_type": "xlsx",
                    "file_content": "last_row",
                },
                "expected": {"type": "rule", "rules": {"expected": ["a"]}},
                "options": {"type": "list"},
            },
        }
    )
    assert run(evaluate_task(t, vm, DONE, sleep=no_sleep)) == 0.0


def test_execute_until_is_met_by_any_condition(vm):
    # upstream ends the retries when ANY of returncode / stdout / stderr matches
    calls = []

    async def sleep(s):
        calls.append(s)

    step = SetupStep(
        type="execute",
        parameters={
            "command": "echo ready; exit 3",
            "shell": True,
            "until": {"returncode": 0, "stdout": "ready"},
        },
    )
    run(run_setup([step], vm, ctx=SetupContext(sleep=sleep)))
    assert calls == []  # met on the first try (stdout), though the return code is 3


def test_open_upload_file_and_close_window_steps(vm, tmp_path):
    asset = tmp_path / "task" / "assets" / "in.txt"
    asset.parent.mkdir(parents=True)
    asset.write_text("IN")
    vm.missing_windows.add("gone")
    steps = [
        SetupStep(
            type="upload_file",
            parameters={
                "files": [{"local_path": "assets/in.txt", "path": "/home/user/Desktop/in.txt"}]
            },
        ),
        SetupStep(type="open", parameters={"path": "/home/user/Desktop/in.txt"}),
        SetupStep(type="close_window", parameters={"window_name": "gone", "strict": True}),
    ]
    run(run_setup(steps, vm, ctx=SetupContext(base_dir=tmp_path / "task")))
    assert vm.local("/home/user/Desktop/in.txt").read_text() == "IN"
    assert vm.log == ["open '/home/user/Desktop/in.txt'", "close_window 'gone'"]
    from osworld_jax.env.setup import SetupStepError

    bad = SetupStep(
        type="upload_file", parameters={"files": [{"local_path": "nope", "path": "/x"}]}
    )
    with pytest.raises(SetupStepError, match="nope not found"):
        run(run_setup([bad], vm, ctx=SetupContext(base_dir=tmp_path / "task")))

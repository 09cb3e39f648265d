"""The ``rule_relativeTime`` getter: dates like "next Monday" made absolute (no jax).

Follows upstream ``getters/misc.get_rule_relativeTime``: "now" is the desktop's local time
(``rules["timezone"]``, when given, overrides it), each relative day of ``rules["relativeTime"]``
(``from`` and optionally ``to``) becomes a date, and the templates of ``rules["expected"]``
(``time``; or ``from``/``to``; or the ``pu*``/``do*`` parts of the "split" forms) are filled with
``{DoW} {Month} {DayD} {Year} {Month0D} {month} {MonthFull} {Day0D} {MonthD}``.
"""

from __future__ import annotations

import copy
import datetime as dt
import zoneinfo
from collections.abc import Mapping
from typing import Any

from osworld_jax.env.backend import SandboxEvalError
from osworld_jax.env.desktop_python import run_python
from osworld_jax.env.evaluators.registry import GETTERS, EvalContext
from osworld_jax.env.protocol import VMProtocol

_DOW = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MON = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")  # fmt: skip


def fill_time_template(template: str, day: dt.datetime) -> str:
    """Replaces the first occurrence of each placeholder (upstream ``apply_rules_to_timeFormat``).

    >>> fill_time_template("{DoW}, {Month} {DayD}, {Year}", dt.datetime(2024, 3, 5))
    'Tue, Mar 5, 2024'
    """
    for key, value in (
        ("{DoW}", _DOW[day.weekday()]),
        ("{Month}", _MON[day.month - 1]),
        ("{DayD}", str(day.day)),
        ("{Year}", str(day.year)),
        ("{Month0D}", f"{day.month:02d}"),
        ("{month}", _MONTH[day.month - 1].lower()),
        ("{MonthFull}", _MONTH[day.month - 1]),
        ("{Day0D}", f"{day.day:02d}"),
        ("{MonthD}", str(day.month)),
    ):
        template = template.replace(key, value, 1)
    return template


def _day_of_next_month(now: dt.datetime, day: int) -> dt.datetime:
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return dt.datetime(year, month, day, tzinfo=now.tzinfo)


def _first_monday(now: dt.datetime, months_later: int) -> dt.datetime:
    # Upstream computes the month as (m + k) % 12 and crashes when that is 0; December it is.
    month = (now.month + months_later - 1) % 12 + 1
    year = now.year + (1 if now.month + months_later > 12 else 0)
    first = dt.datetime(year, month, 1, tzinfo=now.tzinfo)
    return first + dt.timedelta(days=(7 - first.weekday()) % 7)


def _plus(now: dt.datetime, days: int) -> dt.datetime:
    return now + dt.timedelta(days=days)


def _from_day(name: str, now: dt.datetime) -> dt.datetime:
    """The absolute day of a ``from`` (or single) relative time."""
    wd = now.weekday()
    simple = {
        "tomorrow": lambda: _plus(now, 1),
        "this month": lambda: now,
        "5th next month": lambda: _day_of_next_month(now, 5),
        "10th next month": lambda: _day_of_next_month(now, 10),
        "next Monday": lambda: _plus(now, 7 - wd),
        "next Monday split": lambda: _plus(now, 7 - wd),
        "this Saturday": lambda: _plus(now, 5 - wd),
        "next Friday": lambda: _plus(now, 4 - wd if wd < 4 else 7 if wd == 4 else 11 - wd),
        "next Saturday": lambda: _plus(now, 5 - wd if wd < 5 else 7 if wd == 5 else 6),
        "next week Friday": lambda: _plus(now, 11 - wd),
        "next week Saturday": lambda: _plus(now, 12 - wd),
        "next week Sunday": lambda: _plus(now, 13 - wd),
        "first monday four months later": lambda: _first_monday(now, 4),
        "first monday eight months later": lambda: _first_monday(now, 8),
    }
    if name not in simple:
        raise SandboxEvalError(f"getter rule_relativeTime: unknown relative time {name!r}")
    return simple[name]()


def _to_day(name: str, start_name: str, start: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The absolute day of a ``to`` relative time (some count from the ``from`` day)."""
    wd = now.weekday()
    if name == "tomorrow":
        return _plus(now, 1)
    if name == "this Sunday":
        return _plus(now, 6 - wd)
    if name == "11th next month":
        return _day_of_next_month(now, 11)
    if name in ("next Friday", "next Friday split"):
        if start_name in ("next Monday", "next Monday split"):
            return start + dt.timedelta(days=4)
        return _plus(now, 4 - wd if wd < 4 else 11 - wd)
    if name == "next Sunday":
        if start_name in ("next Friday", "next Saturday"):
            return start + dt.timedelta(days=6 - start.weekday())
        return _plus(now, 6 - wd if wd < 6 else 7)
    if name == "next week Sunday":
        if start_name in ("next week Friday", "next week Saturday"):
            return start + dt.timedelta(days=6 - start.weekday())
        return _plus(now, 13 - wd)
    raise SandboxEvalError(f"getter rule_relativeTime: unknown relative time {name!r}")


def resolve_relative_time(rules: Mapping[str, Any], now: dt.datetime) -> dict[str, Any]:
    """``rules`` with its ``expected`` templates filled for the relative days at ``now``."""
    out = copy.deepcopy(dict(rules))
    rel, exp = out["relativeTime"], out["expected"]
    start = _from_day(rel["from"], now)
    if "to" not in rel:
        t = exp["time"]
        exp["time"] = (
            [fill_time_template(x, start) for x in t]
            if isinstance(t, list)
            else fill_time_template(t, start)
        )
        return out
    if rel["from"] == "next Monday split":
        for k in ("puDay", "puMonth", "puYear"):
            exp[k] = fill_time_template(exp[k], start)
    else:
        exp["from"] = fill_time_template(exp["from"], start)
    end = _to_day(rel["to"], rel["from"], start, now)
    if rel["to"] == "next Friday split":
        for k in ("doDay", "doMonth", "doYear"):
            exp[k] = fill_time_template(exp[k], end)
    else:
        exp["to"] = fill_time_template(exp["to"], end)
    return out


_NOW = "from datetime import datetime; import json; print(json.dumps(datetime.now().astimezone().isoformat()))"  # noqa: E501


async def desktop_now(vm: VMProtocol, timezone: str | None = None) -> dt.datetime:
    """The current time: in ``timezone`` when given (UTC if unknown), else the desktop's own."""
    if timezone:
        try:
            return dt.datetime.now(zoneinfo.ZoneInfo(timezone))
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            return dt.datetime.now(dt.UTC)
    return dt.datetime.fromisoformat(str(await run_python(vm, _NOW)))


@GETTERS.register("rule_relativeTime")
async def rule_relative_time(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The ``rules`` object with its relative dates resolved (see the module docstring)."""
    rules = params["rules"]
    now = await desktop_now(vm, rules.get("timezone"))
    return resolve_relative_time(rules, now)

"""Local sandbox benchmark: create, fork(n), step and memory per jailed desktop.

Usage:
  .venv/bin/python benchmarks/sandbox.py [--repeats 3] [--fork-n 8] [--steps 5]
      [--tasks os-rename-draft,editor-append-the-end,calc-sum-column,chrome-close-tab]
      [--warm-pool 0]

Tasks are bundled ones (``osworld_jax/env/bundled``): ``editor-*`` open Mousepad, and the
application tasks (``bundled/apps``, with ``bash scripts/setup.sh --apps``) open a document in
LibreOffice (``calc-sum-column``: Calc with a workbook), start Chromium with two tabs
(``chrome-close-tab``), GIMP, VLC or Thunderbird; their create includes the app's start until
its window shows.

For each bundled task: ``create`` (its real setup; the task's own ``sleep`` steps are reported
separately and subtracted in "create-sleeps"), ``fork(n)`` of that sandbox (its re-run steps
include the same sleeps), the mean ``step`` time of a small pyautogui action with a full
observation (screenshot + a11y tree + terminal), and memory: the summed RSS and the summed peak RSS
(VmHWM) of every process of one jail (bwrap, dbus, server, Xvfb, window manager, apps; shared
pages counted in each process), and what the jail's memory cgroup charges (the figure
``LocalBackendConfig.memory_bytes`` limits: resident pages and tmpfs files, shared ones once;
current and peak, when a memory cgroup limits the jails). Targets
(issue 6): create <= 3 s beyond the task's sleeps; fork(8) <= 1.5 x one create.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from osworld_jax.env.actions import parse_action
from osworld_jax.env.bundled import bundled_app_task_dir, bundled_task_dir
from osworld_jax.env.local import LocalBackend, LocalBackendConfig, LocalSandbox
from osworld_jax.env.tasks import Task, load_task

STEP_ACTION = "```python\npyautogui.moveTo(400, 300)\npyautogui.click()\n```"


def _kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_mib(sb: LocalSandbox) -> tuple[float, float]:
    """(current RSS, peak RSS) summed over the jail's processes, in MiB."""
    pids = sb.desktop.host_pids()
    return (
        sum(_kib(p, "VmRSS") for p in pids) / 1024,
        sum(_kib(p, "VmHWM") for p in pids) / 1024,
    )


def cgroup_mib(sb: LocalSandbox) -> tuple[float, float]:
    """(current, peak) memory charged to the jail's cgroup, in MiB (0 without one)."""
    cg = sb.desktop.cgroup
    if cg is None or cg.memory is None:
        return 0.0, 0.0
    names = (
        ("memory.current", "memory.peak")
        if cg.version == "v2"
        else ("memory.usage_in_bytes", "memory.max_usage_in_bytes")
    )
    out = []
    for name in names:
        try:
            out.append(int((cg.memory / name).read_text()) / 2**20)
        except (OSError, ValueError):
            out.append(0.0)
    return out[0], out[1]


def task_sleeps(task: Task) -> float:
    return sum(float(s.parameters.get("seconds", 0)) for s in task.config if s.type == "sleep")


async def bench_task(backend: LocalBackend, task: Task, args: argparse.Namespace) -> dict:
    creates, forks, steps, rss, hwm, cg_now, cg_peak = [], [], [], [], [], [], []
    for _ in range(args.repeats):
        if args.warm_pool:
            await backend.wait_pool_full()
        t0 = time.perf_counter()
        sb = await backend.create(task)
        creates.append(time.perf_counter() - t0)
        if args.warm_pool:
            await backend.wait_pool_full()
        t0 = time.perf_counter()
        children = await backend.fork(sb, args.fork_n)
        forks.append(time.perf_counter() - t0)
        action = parse_action(STEP_ACTION)
        await children[0].step(action)  # warm-up (first a11y query starts the registry)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            await children[0].step(action)
            steps.append(time.perf_counter() - t0)
        for s in (sb, *children):
            r, h = memory_mib(s)
            rss.append(r)
            hwm.append(h)
            c, cp = cgroup_mib(s)
            cg_now.append(c)
            cg_peak.append(cp)
        for s in (*children, sb):
            await s.close()
    assert backend.inventory() == [], backend.inventory()
    sleeps = task_sleeps(task)
    create = statistics.median(creates)
    fork = statistics.median(forks)
    return {
        "task": task.id,
        "sleeps_s": sleeps,
        "create_s": create,
        "create_minus_sleeps_s": create - sleeps,
        f"fork{args.fork_n}_s": fork,
        "fork/create": fork / create,
        "step_s": statistics.median(steps),
        "rss_mib": statistics.median(rss),
        "peak_rss_mib": max(hwm),
        "cgroup_mib": statistics.median(cg_now),
        "cgroup_peak_mib": max(cg_peak),
    }


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    fmt = {c: (lambda v: v if isinstance(v, str) else f"{v:.2f}") for c in cols}
    cells = [[fmt[c](r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fork-n", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--tasks", default="os-rename-draft,editor-append-the-end,calc-sum-column,chrome-close-tab"
    )
    p.add_argument("--warm-pool", type=int, default=0)
    args = p.parse_args()
    paths = {
        load_task(q).id: q
        for root in (bundled_task_dir(), bundled_app_task_dir())
        for q in root.rglob("*.json")
        if "assets" not in q.parts
    }
    backend = LocalBackend(LocalBackendConfig(warm_pool=args.warm_pool))
    backend.preflight()
    rows = []
    try:
        for tid in args.tasks.split(","):
            rows.append(await bench_task(backend, load_task(paths[tid]), args))
    finally:
        await backend.aclose()
    print(f"repeats={args.repeats} fork_n={args.fork_n} warm_pool={args.warm_pool} (medians)")
    print_table(rows)


if __name__ == "__main__":
    asyncio.run(main())

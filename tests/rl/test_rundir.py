"""The run directory's storage fails as one line naming the path and the cause, losing nothing.

Issue 16 item 11: a read-only run directory and a full disk gave tracebacks. The real thing:
size-limited and read-only tmpfs mounts (CI runs as root), ``scripts/train.py`` as a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from osworld_jax.rl.rundir import (
    StorageError,
    check_writable,
    complete_checkpoints,
    storage_error,
    trim_logs_to_checkpoint,
    trim_partial_line,
    trim_to_step,
)
from tests.rl.runs import (
    REPO,
    Tmpfs,
    live_processes_mentioning,
    quick_args,
    quick_tasks,
    run_env,
    train_cmd,
)

# What orbax (tensorstore) raised when a checkpoint did not fit (copied from a real run).
TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file '
    '"/mnt/run/checkpoints/1.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": '
    'Failed writing: "/mnt/run/checkpoints/1.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/'
    'ocdbt.process_0/d/2181853d": Failed to write 3512676 bytes to file 14: No space left on '
    "device [os_error_code='28']"
)


@pytest.fixture
def tmpfs():
    mounts = Tmpfs()
    yield mounts
    mounts.unmount_all()


def test_storage_error_is_found_anywhere_in_the_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/r/metrics.jsonl")
        except OSError as e:
            raise RuntimeError("while logging") from e
    except RuntimeError as e:
        err = storage_error(e)
    assert str(err) == "/r/metrics.jsonl: No space left on device"
    err = storage_error(ValueError(TENSORSTORE_ENOSPC))
    assert err is not None and err.errno == errno.ENOSPC
    assert err.path.endswith("ocdbt.process_0/d/2181853d")
    group = ExceptionGroup("cleanup", [KeyError("x"), OSError(errno.EROFS, "ro", "/r/x")])
    assert str(storage_error(group)) == "/r/x: Read-only file system"
    assert storage_error(OSError(errno.ECONNREFUSED, "refused")) is None  # not storage
    assert storage_error(ValueError("a bug")) is None


def test_trim_partial_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert trim_partial_line(f) == 0  # no file
    f.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert trim_partial_line(f) == len('{"st')
    assert f.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert trim_partial_line(f) == 0
    f.write_text("no newline at all")
    assert trim_partial_line(f) == len("no newline at all") and f.read_text() == ""


def _jsonl(path: Path, steps: list[int], per_step: int) -> None:
    with path.open("a") as f:
        for step in steps:
            for i in range(per_step):
                f.write(json.dumps({"step": step, "owner": i}) + "\n")


def test_logs_are_trimmed_to_the_checkpoint_the_run_resumes_from(tmp_path):
    """Issue 33 item 17: step 2 was logged (metrics, 8 owner records, episodes), then its
    checkpoint failed (disk full) or the trainer died before it completed; checkpoint 1 is the
    last complete one. Resuming from it runs step 2 again: without the trim, step 2 was logged
    twice (16 rollout records). The dropped records are set aside, not deleted."""
    _jsonl(tmp_path / "metrics.jsonl", [1, 2], 1)
    _jsonl(tmp_path / "rollouts.jsonl", [1, 2], 8)
    with (tmp_path / "rollouts.jsonl").open("a") as f:
        f.write('{"note": "no step"}\n{"step": 2, "owner"')  # a line without a step, a cut one
    episodes = tmp_path / "episodes"
    (episodes / "images").mkdir(parents=True)
    for name in ("step_00000001_owner_0.json", "step_00000002_owner_0.json", "images/a.png"):
        (episodes / name).write_text("{}")
    dropped = trim_logs_to_checkpoint(
        tmp_path, 1, ("metrics.jsonl", "rollouts.jsonl", "absent.jsonl"), "episodes"
    )
    assert dropped == {"metrics.jsonl": 1, "rollouts.jsonl": 8, "episodes": 1}
    _jsonl(tmp_path / "metrics.jsonl", [2], 1)  # the resumed run logs step 2 again
    _jsonl(tmp_path / "rollouts.jsonl", [2], 8)

    def steps(name: str) -> list[int | None]:
        return [json.loads(x).get("step") for x in (tmp_path / name).read_text().splitlines()]

    assert steps("metrics.jsonl") == [1, 2]
    assert steps("rollouts.jsonl") == [1] * 8 + [None] + [2] * 8
    assert steps("rollouts.jsonl.set-aside") == [2] * 8
    assert sorted(p.name for p in episodes.iterdir()) == [
        "images",
        "step_00000001_owner_0.json",
        "step_00000002_owner_0.json.set-aside",
    ]
    # nothing after the checkpoint: nothing changes (a fresh start trims to step 0)
    assert trim_logs_to_checkpoint(tmp_path, 2, ("metrics.jsonl",), "episodes") == {}
    assert trim_to_step(tmp_path / "metrics.jsonl", 0) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_line_nested_too_deeply_is_set_aside_with_its_file_and_line_named(tmp_path, caplog):
    """One line of ``[`` x 100000 made json.loads raise RecursionError and the resume crash.
    Resume now sets such a line aside (warning ``<file>:<line>``), keeps every readable
    record, and the metrics reader skips it the same way."""
    from osworld_jax.rl.metrics import read_metrics

    deep = "[" * 100_000 + "]" * 100_000
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        _jsonl(tmp_path / name, [1], 1)
        with (tmp_path / name).open("a") as f:
            f.write(deep + "\n" + '{"step": 1, "x": 2}\n')
    metrics = tmp_path / "metrics.jsonl"
    with caplog.at_level("WARNING", logger="osworld_jax.rl"):
        assert read_metrics(tmp_path)[0]["x"] == 2  # the later record of step 1, the bad skipped
        assert f"{metrics}:2: unreadable JSON line skipped (nested too deeply)" in caplog.text
        caplog.clear()
        dropped = trim_logs_to_checkpoint(
            tmp_path, 1, ("metrics.jsonl", "rollouts.jsonl"), "episodes"
        )
    assert dropped == {"metrics.jsonl": 1, "rollouts.jsonl": 1}
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert f"{tmp_path / name}:2: unreadable" in caplog.text
        assert [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()] == [1, 1]
        assert (tmp_path / f"{name}.set-aside").read_text() == deep + "\n"


def test_check_writable_names_the_read_only_directory(tmp_path, tmpfs):
    ro = tmpfs.mount(tmp_path / "ro", "1m", read_only=True)
    with pytest.raises(StorageError, match=r"/ro/run: Read-only file system$"):
        check_writable(ro / "run")
    full = tmpfs.mount(tmp_path / "full", "8k")
    (full / "filler").write_bytes(b"\0" * 8192)
    with pytest.raises(StorageError, match=r"No space left on device$"):
        check_writable(full)
    assert not list(full.glob(".write-probe-*"))  # the probe never stays behind
    check_writable(tmp_path / "ok" / "run")
    assert (tmp_path / "ok" / "run").is_dir() and not list((tmp_path / "ok" / "run").iterdir())


def _fill(directory: Path) -> Path:
    """Writes ``directory/filler`` until the file system is full."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\xa5" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _error_line(out: str) -> str:
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines, out
    assert "Traceback" not in out, out[-3000:]
    return lines[-1]


@pytest.mark.slow
def test_a_failed_start_leaves_an_existing_runs_config_alone(tmp_path):
    """Issue 16 item 9: a start that fails (here: a missing task directory, found by preflight)
    must not replace the run's operative_config.gin / experiment.json."""
    tasks, run_dir = quick_tasks(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    names = ("operative_config.gin", "experiment.json")
    before = {name: f"the previous run's {name}\n" for name in names}
    for name, text in before.items():
        (run_dir / name).write_text(text)
    missing = tmp_path / "no-such-tasks"
    r = subprocess.run(
        train_cmd(run_dir, *quick_args(tasks, f"DataConfig.task_set = '{missing}'"), steps=1),
        cwd=REPO,
        env=run_env(run_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert str(missing) in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    for name, text in before.items():
        assert (run_dir / name).read_text() == text, name
    assert not live_processes_mentioning(str(run_dir))


@pytest.mark.slow
def test_read_only_run_dir_is_one_line(tmp_path, tmpfs):
    """A new run in a read-only place, then an existing run whose directory became read-only."""
    tasks = quick_tasks(tmp_path)
    disk = tmpfs.mount(tmp_path / "disk", "64m", read_only=True)
    run_dir = disk / "run"
    r = subprocess.run(
        train_cmd(run_dir, *quick_args(tasks), steps=1),
        cwd=REPO,
        env=run_env(run_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert _error_line(r.stderr) == (
        f"error: {run_dir}: Read-only file system (no checkpoint yet; fix the storage and "
        "rerun the same command to resume)"
    )
    assert not live_processes_mentioning(str(run_dir))


@pytest.mark.slow
def test_full_disk_mid_run_is_one_line_and_the_run_resumes(tmp_path, tmpfs):
    """The disk fills during step 2: one line naming the file, checkpoint 1 and the logs
    intact; once space is freed the same command resumes at step 2 and finishes."""
    tasks = quick_tasks(tmp_path)
    disk = tmpfs.mount(tmp_path / "disk", "96m")
    run_dir = disk / "run"
    cmd = train_cmd(run_dir, *quick_args(tasks), steps=3)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=run_env(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 480
    while not complete_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 1"
        time.sleep(0.05)
    # Frozen while the disk fills, so step 2 cannot complete its checkpoint first.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        filler = _fill(disk)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, err = (x.decode() for x in proc.communicate(timeout=300))
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    line = _error_line(err)
    print(line)
    assert line.startswith(f"error: {run_dir}/"), line
    assert line.endswith(
        ": No space left on device (checkpoint 1 is the last complete one; fix the storage "
        "and rerun the same command to resume)"
    ), line
    assert not live_processes_mentioning(str(run_dir))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][:1] == [1]

    filler.unlink()
    again = subprocess.run(
        cmd, cwd=REPO, env=run_env(run_dir), capture_output=True, text=True, timeout=480
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps  # resumed after checkpoint 1; step 2 logged once (issue 33)
    lines = (run_dir / "rollouts.jsonl").read_text().splitlines()
    owners = [(r["step"], r["owner"]) for r in map(json.loads, lines)]
    assert len(owners) == len(set(owners)), owners  # no owner of a step logged twice
    assert complete_checkpoints(run_dir)[-1] == 3
    assert not live_processes_mentioning(str(run_dir))


def test_quiet_storage_tracebacks_drops_only_orbax_abandoned_reads(monkeypatch):
    """A damaged checkpoint makes orbax abandon its other array reads; Python would report each
    abandoned coroutine with a traceback after the run's one line. Only those are dropped."""
    import logging
    import sys
    import types

    from osworld_jax.rl.rundir import quiet_storage_tracebacks

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "filters", list(absl.filters))
    quiet_storage_tracebacks()
    scope: dict = {}
    exec(compile("async def read():\n    pass\n", f"/site/orbax{os.sep}io.py", "exec"), scope)
    exec(compile("async def mine():\n    pass\n", "/site/osworld_jax/io.py", "exec"), scope)
    orbax, other = scope["read"](), scope["mine"]()
    for coro in (orbax, other):
        sys.unraisablehook(
            types.SimpleNamespace(
                object=coro, exc_value=ValueError("x"), exc_traceback=None, err_msg=None
            )
        )
        coro.close()
    assert [u.object for u in seen] == [other]


def test_quiet_storage_tracebacks_drops_only_orbax_tasks_never_retrieved(monkeypatch, caplog):
    """The abandoned reads that ended in an exception: asyncio logs each ("Task exception was
    never retrieved", with a traceback) when it is collected. Only orbax's are dropped."""
    import asyncio
    import gc
    import logging

    from osworld_jax.rl.rundir import quiet_storage_tracebacks

    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "filters", list(logger.filters))
    quiet_storage_tracebacks()
    scope: dict = {}
    code = "async def read():\n    raise ValueError('ZSTD_decompressStream() failed')\n"
    exec(compile(code, f"/site/orbax{os.sep}io.py", "exec"), scope)
    exec(compile(code.replace("read", "mine"), "/site/osworld_jax/io.py", "exec"), scope)

    async def abandon() -> None:
        for fn in (scope["read"], scope["mine"]):
            asyncio.ensure_future(fn())
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(abandon())
        gc.collect()
    reported = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [r.exc_info[2].tb_frame.f_code.co_filename for r in reported if r.exc_info] == [
        "/site/osworld_jax/io.py"
    ], [r.getMessage() for r in reported]


def test_quiet_storage_tracebacks_drops_tensorstore_futures_never_retrieved(monkeypatch, caplog):
    """A read or write that tensorstore completed with an error after orbax stopped awaiting it:
    asyncio logs its future when collected, with no traceback, so the report's last line is a
    bare ``ValueError: FAILED_PRECONDITION: ...`` after the run's one line (seen on CI under
    both the corrupt-checkpoint and the full-disk run). Those are dropped; a future that failed
    with anything else is still reported."""
    import asyncio
    import gc
    import logging

    from osworld_jax.rl.rundir import quiet_storage_tracebacks

    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "filters", list(logger.filters))
    quiet_storage_tracebacks()
    errors = [
        ValueError('FAILED_PRECONDITION: Error reading "params.mlp.gate/0.0.0" in OCDBT'),
        ValueError("RESOURCE_EXHAUSTED: Error writing \"x\" [os_error_code='28']"),
        ValueError("FAILED_PRECONDITION but not a status"),
        KeyError("DATA_LOSS: a KeyError is not tensorstore's"),
    ]

    async def abandon() -> None:
        loop = asyncio.get_running_loop()
        for error in errors:
            loop.create_future().set_exception(error)  # completed, never awaited
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(abandon())
        gc.collect()
    reported = [r.exc_info[1] for r in caplog.records if "never retrieved" in r.getMessage()]
    assert reported == errors[2:], reported


def test_quiet_storage_tracebacks_drops_reads_completed_after_their_loop_closed(monkeypatch):
    """A tensorstore read awaited on a loop that orbax closed completes later, from
    tensorstore's thread: ``RuntimeError('Event loop is closed')`` reported as unraisable with
    no object. Only that report is dropped; the same error raised elsewhere still shows."""
    import asyncio
    import logging
    import sys
    import types

    import tensorstore as ts

    from osworld_jax.rl.rundir import quiet_storage_tracebacks

    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    logger = logging.getLogger("absl")
    monkeypatch.setattr(logger, "filters", list(logger.filters))
    logger = logging.getLogger("asyncio")
    monkeypatch.setattr(logger, "filters", list(logger.filters))
    quiet_storage_tracebacks()

    async def start_read():
        promise, future = ts.Promise.new()

        async def wait():
            await future

        task = asyncio.ensure_future(wait())
        await asyncio.sleep(0.01)
        return promise, task

    loop = asyncio.new_event_loop()
    promise, _task = loop.run_until_complete(start_read())
    loop.close()
    promise.set_result(1)  # completes on this thread: the callback finds the loop closed
    time.sleep(0.05)

    def mine() -> None:
        raise RuntimeError("Event loop is closed")

    try:
        mine()
    except RuntimeError as e:
        other = types.SimpleNamespace(
            object=None, exc_value=e, exc_traceback=e.__traceback__, err_msg=None
        )
        sys.unraisablehook(other)
    assert seen == [other], [getattr(u, "exc_value", u) for u in seen]

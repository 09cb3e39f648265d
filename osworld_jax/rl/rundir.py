"""The run directory's storage: checked before a run starts, and its failures as one line.

A run writes into its directory all along (model, operative config, checkpoints, refit exports,
metrics, per-owner records, server log). When that storage refuses a write (read-only, full,
over quota, no permission), the run stops with one line naming the path and the cause, e.g.
``runs/b8n8/weights/step_00000012.tmp-1a2b/model.safetensors: No space left on device``,
instead of a traceback, and nothing already written is lost: checkpoints and exports are
written to a temporary directory and renamed when complete, so the last complete checkpoint
stays the resume point (rerun the same command once the storage is fixed), and the JSONL logs
are appended one whole line at a time (`trim_partial_line` drops a line a full disk cut short).
A step's records are appended before its checkpoint is durable; on every start the logs are
trimmed back to the checkpoint the run resumes from (`trim_logs_to_checkpoint`), so a step that
runs again after a failed save or a crash is logged once.

Storage errors arrive as ``OSError`` from Python and as messages carrying
``[os_error_code='28']`` from tensorstore (orbax's checkpoint writer); `storage_error` finds
either anywhere in an exception's chain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# errno values that mean "this storage refuses the write" (not a bug of the run).
STORAGE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)
_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")
# The file tensorstore failed on, else the database it wrote into.
_TENSORSTORE_PATHS = (re.compile(r'Failed [a-z ]+: "([^"]+)"'), re.compile(r'file "([^"]+)"'))

log = logging.getLogger(__name__)


class StorageError(Exception):
    """The run directory's storage refused a write.

    Attributes:
      path: the file or directory that could not be written.
      errno: the ``errno`` value (one of `STORAGE_ERRNOS`).
    """

    def __init__(self, path: str | os.PathLike[str], err: int) -> None:
        self.path, self.errno = str(path), err
        super().__init__(f"{self.path}: {os.strerror(err)}")


def check_writable(run_dir: Path) -> None:
    """Creates ``run_dir`` if needed and proves it takes a write (a probe file, removed).

    Raises:
      StorageError: the directory cannot be created or written (read-only, full, permission).
    """
    probe = run_dir / f".write-probe-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        raise StorageError(e.filename or run_dir, e.errno) from e
    finally:
        probe.unlink(missing_ok=True)


def _chain(exc: BaseException) -> list[BaseException]:
    out, todo, seen = [], [exc], set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += list(getattr(e, "exceptions", ()))  # ExceptionGroup members
    return out


def _as_storage_error(e: BaseException) -> StorageError | None:
    if isinstance(e, StorageError):
        return e
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
        return StorageError(e.filename or "?", e.errno)
    m = _TENSORSTORE_ERRNO.search(str(e))
    if m and int(m.group(1)) in STORAGE_ERRNOS:
        found = (p.search(str(e)) for p in _TENSORSTORE_PATHS)
        return StorageError(next((f.group(1) for f in found if f), "?"), int(m.group(1)))
    return None


def storage_error(exc: BaseException) -> StorageError | None:
    """The storage failure behind ``exc``, or None if there is none.

    The whole chain is searched (causes, exceptions raised while handling others, exception
    group members); the innermost storage failure that names its path wins: the first write
    that was refused, not the clean-up writes that failed after it.
    """
    found = [s for s in map(_as_storage_error, _chain(exc)) if s is not None]
    named = [s for s in found if s.path != "?"]
    best = named or found
    return best[-1] if best else None


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Names ``path`` in a storage error of the block that names no file.

    ``write`` / ``flush`` / ``fsync`` failures (a full disk) carry no file name; raised inside
    ``with writing(path):`` they become ``OSError(errno, strerror, path)`` (the original as
    its cause).
    """
    try:
        yield
    except OSError as e:
        if e.errno in STORAGE_ERRNOS and not e.filename:
            raise OSError(e.errno, os.strerror(e.errno), str(path)) from e
        raise


class _DropStorageTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and storage_error(error) is not None:
            return False
        return _TENSORSTORE_ERRNO.search(record.getMessage()) is None


def _is_orbax_coroutine(obj: object) -> bool:
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _raised_in_orbax(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) passed through orbax's code."""
    for e in _chain(error):
        tb = e.__traceback__
        while tb is not None:
            if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
    return False


def _late_completion_on_closed_loop(unraisable: Any) -> bool:
    """A read that finished after its event loop was closed, reported from native code.

    tensorstore completes an awaited read from its own thread by calling the loop's
    ``call_soon_threadsafe``; when orbax has already given up on the restore and closed the
    loop, that call raises ``RuntimeError('Event loop is closed')``, which tensorstore reports
    as unraisable with no object and the asyncio call as the outermost frame.
    """
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    return (
        unraisable.object is None
        and isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
        and f"{os.sep}asyncio{os.sep}" in tb.tb_frame.f_code.co_filename
    )


# absl's canonical status codes: how tensorstore's errors begin ("FAILED_PRECONDITION: ...").
_STATUS_CODES = (
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip


def _tensorstore_status(error: BaseException) -> bool:
    """An error that tensorstore set on an awaited read or write (a status, no Python frame)."""
    return (
        isinstance(error, ValueError)
        and error.__traceback__ is None
        and str(error).startswith(tuple(f"{c}: " for c in _STATUS_CODES))
    )


class _DropAbandonedOrbaxTasks(logging.Filter):
    """asyncio's "Task/Future exception was never retrieved" for orbax's abandoned reads.

    Orbax's own coroutines (a traceback through orbax) and the futures that tensorstore
    completed with a status after orbax gave up awaiting them (no traceback at all: logged as
    a bare ``ValueError: FAILED_PRECONDITION: ...`` line after the run's one-line error).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "exception was never retrieved" not in record.getMessage():
            return True
        return not (_raised_in_orbax(error) or _tensorstore_status(error))


def quiet_storage_tracebacks() -> None:
    """Drops library reports that only repeat a failure the run reports as one line.

    For a CLI (``scripts/train.py``): orbax logs each failed background write of a checkpoint
    with its traceback before the failure reaches the run; and when one array of a damaged
    checkpoint fails to read, orbax abandons the reads of the others, whose coroutines Python
    reports ("Exception ignored in: <coroutine ...>", with a traceback) when they are collected,
    and asyncio logs those that ended in an exception ("Task exception was never retrieved"),
    and the futures of reads and writes that tensorstore completed with an error after orbax
    stopped awaiting them ("Future exception was never retrieved": the error has no traceback,
    so the report's last line is a bare ``ValueError: FAILED_PRECONDITION: ...`` or
    ``RESOURCE_EXHAUSTED: ...``, printed whenever they are collected, after the one line);
    reads still in flight complete after orbax closed their event loop, which tensorstore
    reports as an unraisable ``RuntimeError('Event loop is closed')`` raised straight from
    asyncio's ``call_soon_threadsafe``. Other unraisable exceptions and asyncio reports are
    reported as usual.
    """
    logging.getLogger("absl").addFilter(_DropStorageTracebacks())
    logging.getLogger("asyncio").addFilter(_DropAbandonedOrbaxTasks())
    report = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not (
            _is_orbax_coroutine(unraisable.object) or _late_completion_on_closed_loop(unraisable)
        ):
            report(unraisable)

    sys.unraisablehook = hook


OPERATIVE_CONFIG = "operative_config.gin"
RESOLVED_CONFIG = "experiment.json"


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(tmp):
            tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_run_config(run_dir: Path, experiment: Any, operative_gin: str | None = None) -> None:
    """Writes the run's ``experiment.json`` (the resolved config) and ``operative_config.gin``.

    Called once the run is starting (its configuration built, preflight passed, any checkpoint
    restored): a start that fails leaves an existing run's files as they were. Each file is
    replaced atomically (a temporary file renamed), so a failed write keeps the previous one.

    Args:
      run_dir: the run directory.
      experiment: the run's (dataclass) configuration.
      operative_gin: gin's operative config text (None: ``operative_config.gin`` untouched).
    """
    resolved = json.dumps(dataclasses.asdict(experiment), indent=2, sort_keys=True, default=str)
    _replace_file(run_dir / RESOLVED_CONFIG, resolved + "\n")
    if operative_gin is not None:
        _replace_file(run_dir / OPERATIVE_CONFIG, operative_gin)


def complete_checkpoints(run_dir: Path, name: str = "checkpoints") -> list[int]:
    """The steps of ``run_dir/<name>`` that orbax finished (renamed from their temporary name)."""
    root = run_dir / name
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def trim_partial_line(path: Path) -> int:
    """Cuts a last line that was not completed (no newline) off the JSONL file ``path``.

    A full disk can stop an append mid-line; appending after it would glue the next record
    onto the fragment. Returns the number of bytes removed (0 for a whole file or no file).
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep, pos, block = 0, size, 1 << 16
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            pos = start
        f.truncate(keep)
    return size - keep


_UNREADABLE = object()


def json_line(line: bytes | str, path: Path, lineno: int) -> Any:
    """The JSON value of line ``lineno`` of ``path``; `_UNREADABLE` (and a warning naming the
    file and line) when it does not parse: bad JSON, bad UTF-8, nested too deeply for the
    parser (a ``RecursionError``), an integer too long to convert."""  # noqa: D205, D209
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        log.warning("%s:%d: unreadable JSON line skipped (%s)", path, lineno, why[:200])
        return _UNREADABLE


def _record_step(line: bytes, path: Path, lineno: int) -> int | None | object:
    """The record's integer ``step``, None (no such step), or `_UNREADABLE`."""
    if not line.strip():
        return None
    rec = json_line(line, path, lineno)
    if rec is _UNREADABLE:
        return rec
    step = rec.get("step") if isinstance(rec, dict) else None
    return step if type(step) is int else None


def trim_to_step(path: Path, step: int) -> int:
    """Drops the records of steps after ``step`` from the JSONL file ``path``; returns how many.

    On resume from checkpoint ``step`` (0: none), the steps after it run again: their records
    (logged before their checkpoint was durable, or whose checkpoint failed) would be logged
    twice. A line without an integer ``step`` is kept; a line that does not parse is dropped
    too (a warning names the file and line); a cut last line is dropped (see
    `trim_partial_line`). The file is replaced atomically only when something is dropped; the
    dropped records are appended to ``<name>.set-aside`` (nothing is deleted).
    """
    trim_partial_line(path)
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return 0
    with f:

        def drop(s: int | None | object) -> bool:
            return s is _UNREADABLE or (type(s) is int and s > step)

        steps = [_record_step(line, path, n) for n, line in enumerate(f, 1)]
        if not any(drop(s) for s in steps):
            return 0
        f.seek(0)
        tmp, dropped = path.with_name(f".{path.name}.trim-{os.getpid()}"), 0
        try:
            aside = path.with_name(path.name + SET_ASIDE)
            with writing(tmp), open(tmp, "wb") as out, open(aside, "ab") as later:
                for line, s in zip(f, steps, strict=True):
                    if drop(s):
                        later.write(line)
                        dropped += 1
                    else:
                        out.write(line)
                for done in (later, out):
                    done.flush()
                    os.fsync(done.fileno())
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return dropped


SET_ASIDE = ".set-aside"  # suffix of logs moved out of the way (as trainer.checkpoint's)
_EPISODE = re.compile(r"step_(\d+)_owner_\d+\.json")


def remove_episodes_after(episodes_dir: Path, step: int) -> int:
    """Sets aside the episode files (``step_<n>_owner_<i>.json``) of steps after ``step``.

    On resume those steps run again and write their episodes anew (an existing file is never
    rewritten, so a stale one would stay). Each is renamed to ``<name>.set-aside``. Returns how
    many were.
    """
    if not episodes_dir.is_dir():
        return 0
    removed = 0
    for p in episodes_dir.iterdir():
        m = _EPISODE.fullmatch(p.name)
        if m and int(m.group(1)) > step:
            p.replace(p.with_name(p.name + SET_ASIDE))
            removed += 1
    return removed


def trim_logs_to_checkpoint(metrics_dir: Path, step: int, jsonl_files: Sequence[str],
                            episodes_dir: str) -> dict[str, int]:  # fmt: skip
    """Makes a run's logs consistent with its checkpoint ``step`` before it resumes (or starts).

    Every JSONL file of ``jsonl_files`` loses the records of steps after ``step``
    (`trim_to_step`) and the episodes of those steps are set aside (`remove_episodes_after`).

    Returns:
      name -> records (files) dropped, only where something was.
    """
    dropped = {name: trim_to_step(metrics_dir / name, step) for name in jsonl_files}
    dropped[episodes_dir] = remove_episodes_after(metrics_dir / episodes_dir, step)
    return {k: v for k, v in dropped.items() if v}


#: Bindings a resumed run may change freely: how long it runs, how it logs and checkpoints,
#: where its servers and processes are. Everything else (the model, the data, the algorithm)
#: must match the run's own ``experiment.json`` unless the change is allowed explicitly.
RUN_LENGTH_KNOBS = frozenset(
    {
        "RLConfig.steps",
        "RLConfig.progress_bar",
        "RLConfig.weights_keep",
        "RLConfig.episode_owners",
        "RLConfig.max_consecutive_skipped_steps",
        "RLConfig.compilation_cache_dir",
        "MeshConfig.device_memory_gib",
        "ServerConfig.device_memory_fraction",
        "ServerConfig.host",
        "ServerConfig.port",
        "ServerConfig.startup_timeout_s",
        "RolloutConfig.urls",
        "RolloutConfig.connect_timeout_s",
    }
)
#: Config classes all of whose fields may change on resume (checkpoint cadence, the job's hosts).
RUN_LENGTH_CLASSES = frozenset({"CheckpointConfig", "DistributedConfig"})


def _default(f: dataclasses.Field) -> Any:
    """The default of a dataclass field (``dataclasses.MISSING`` when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _walk(new: Any, old: dict[str, Any], out: list[str]) -> None:
    """Appends ``Class.field: old -> new`` for each field of dataclass ``new`` that differs.

    A field the run's config does not have (added to the code since the run started) at its
    default is not a change: upgrading the code does not stop a run from resuming.
    """
    cls = type(new).__name__
    for f in dataclasses.fields(new):
        key, value = f"{cls}.{f.name}", getattr(new, f.name)
        if f.name not in old and value == _default(f):
            continue
        before = old.get(f.name, "<absent>")
        if dataclasses.is_dataclass(value) and isinstance(before, dict):
            if set(before) <= {g.name for g in dataclasses.fields(value)}:  # the same class
                _walk(value, before, out)
                continue
        if key in RUN_LENGTH_KNOBS or cls in RUN_LENGTH_CLASSES:
            continue
        is_config = dataclasses.is_dataclass(value) and not isinstance(value, type)
        plain = dataclasses.asdict(value) if is_config else value
        now = json.loads(json.dumps(plain, default=str))  # as experiment.json holds it
        if now != before:
            out.append(f"{key}: {before!r} -> {now!r}")


def config_changes(run_dir: Path, experiment: Any) -> list[str]:
    """The bindings of ``experiment`` that differ from the run's own ``experiment.json``.

    Run-length knobs (`RUN_LENGTH_KNOBS`, `RUN_LENGTH_CLASSES`) are ignored. A run directory
    without ``experiment.json`` (a run that never started) has nothing to differ from.

    Returns:
      ``"Class.field: old -> new"`` per differing binding (empty: the same config).
    """
    path = run_dir / RESOLVED_CONFIG
    if not path.is_file():
        return []
    out: list[str] = []
    try:
        own = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise ConfigError(
            f"{path}: unreadable ({why[:200]}); restore it, or use another --run_dir"
        ) from None
    _walk(experiment, own, out)
    return out


LATEST = "latest"


def point_latest_at(run_dir: Path) -> Path | None:
    """Points ``<parent>/latest`` at ``run_dir`` (a relative symlink, replaced atomically).

    Returns the link, or None where ``latest`` is something other than a symlink (left alone)
    or the parent cannot take a symlink.
    """
    link = run_dir.parent / LATEST
    if run_dir.name == LATEST or (link.exists() and not link.is_symlink()):
        return None
    tmp = link.with_name(f".{LATEST}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)
        tmp.replace(link)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return link

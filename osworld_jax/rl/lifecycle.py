"""A run's life as its command sees it: plan, run, fail, and where the results are.

``scripts/train.py`` parses its flags, builds the experiment and calls `launch`; what a run
decides about its directory lives here.

- **Plan** (`plan_run`, nothing written): a directory with complete checkpoints resumes after
  the newest (or ``CheckpointConfig.restore_step``) with the run's own config. A changed model,
  data or algorithm binding (`rundir.config_changes`) is refused (`RunRefused`) naming the
  bindings and the two ways on: a new ``--run_dir`` that starts from this run's newest weights
  export, or ``--allow_config_change`` (the change is then appended to ``config_changes.log``).
  A finished run says so and exits 0 with the same config, and is refused with another one.
- **Run** (`launch`): prints the directory, calls `loop.train`, prints the summary, why a
  reward stayed 0 (`zero_reward_note`) and where the results are; ``runs/latest`` points at a
  run that ran (a refused or finished one leaves it alone).
- **Fail**: a refusal before anything started (a config or preflight error, a plan that does
  not fit, Ctrl-C during the checks) removes the directory this command created, so a typo
  leaves nothing behind. Any later failure keeps the directory (``server.log``, metrics,
  checkpoints) and writes ``error.txt`` in it (one line, then the traceback). On stderr a
  known failure is one line (`failure_line`): the storage, a damaged checkpoint, a lost
  process, an out of memory (the program, the bytes, the knob), a rollout server that died
  (its log); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
import shutil
import sys
import traceback
from pathlib import Path

from osworld_jax.contract.errors import EngineError, RefitError, RolloutError
from osworld_jax.errors import ConfigError, OsworldJaxError, PreflightError
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rl.loop import TrainResult, train
from osworld_jax.rl.rundir import (
    RESOLVED_CONFIG,
    complete_checkpoints,
    config_changes,
    point_latest_at,
    quiet_storage_tracebacks,
    storage_error,
)
from osworld_jax.rl.stages import RolloutStepError, SkippedStepsError
from osworld_jax.trainer.checkpoint import CorruptCheckpointError
from osworld_jax.trainer.distributed import DistributedError
from osworld_jax.trainer.state import TrainerError

CONFIG_CHANGES_LOG = "config_changes.log"
ERROR_FILE = "error.txt"
RUN_LOG = "run.log"
DEMO = "scripts/demo_learning.py"
ONE_GPU_RECIPE = "configs/gpu_1x_h100.gin"
#: What only a run that got past its checks writes (the server's log first of all).
STARTED = ("server.log", "sglang_*.log", "weights", "checkpoints", RESOLVED_CONFIG, ERROR_FILE)


class RunRefused(ConfigError):
    """The run must not start here as asked (the message names why and the ways on)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRequest:
    """What the command asks for.

    Attributes:
      experiment: the built configuration.
      run_dir: the run directory (new, or one to resume).
      steps: the last step to run (None: ``RLConfig.steps``).
      operative_gin: gin's operative config, written with ``experiment.json`` at the start.
      allow_config_change: resume although model/data/algorithm bindings differ (logged).
    """

    experiment: ExperimentConfig
    run_dir: Path
    steps: int | None = None
    operative_gin: str | None = None
    allow_config_change: bool = False

    @property
    def last_step(self) -> int:
        """The step the run ends after."""
        return self.steps if self.steps is not None else self.experiment.rl.steps


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan_run` decided.

    Attributes:
      resume_from: the checkpoint the run resumes from (None: a fresh start).
      finished: nothing is left to run (the checkpoint is at or past the last step).
      changes: allowed config changes (``Class.field: old -> new``), logged at the start.
    """

    resume_from: int | None
    finished: bool = False
    changes: tuple[str, ...] = ()


def newest_export(run_dir: Path, up_to: int | None = None) -> Path | None:
    """The newest refit export ``weights/step_<n>`` (an HF checkpoint) with ``n <= up_to``."""
    found = [
        p
        for p in (run_dir / "weights").glob("step_*")
        if p.name[5:].isdigit() and (up_to is None or int(p.name[5:]) <= up_to)
    ]
    return max(found, key=lambda p: int(p.name[5:]), default=None)


def _ways_on(run_dir: Path, last: int, finished: bool) -> str:
    export = newest_export(run_dir, last)
    new = "a new --run_dir"
    if export is not None:
        new += f" (from this run's weights: --gin_param=\"ModelSourceConfig.path = '{export}'\")"
    here = "--allow_config_change" + (f" with --steps=N, N > {last}," if finished else "")
    return f"to train with it, use {new}, or pass {here} to go on in this directory"


def plan_run(request: RunRequest) -> Plan:
    """Decides new, resume or finished for ``request.run_dir``; writes nothing.

    Raises:
      RunRefused: the run was trained with another model, data or algorithm binding (and
        ``allow_config_change`` is off, or the run is finished).
    """
    run_dir, exp = request.run_dir, request.experiment
    steps = complete_checkpoints(run_dir)
    if not steps:
        return Plan(resume_from=None)
    restore = exp.trainer.checkpoint.restore_step
    finished = restore is None and steps[-1] >= request.last_step
    changes = tuple(config_changes(run_dir, exp))
    if changes and (finished or not request.allow_config_change):
        what = f"finished at step {steps[-1]}" if finished else "trained"
        raise RunRefused(
            f"{run_dir} was {what} with another config; changed: {'; '.join(changes)}; "
            + _ways_on(run_dir, steps[-1], finished)
        )
    resume = restore if restore is not None else steps[-1]
    return Plan(resume_from=resume, finished=finished, changes=changes)


def where_results_are(run_dir: Path, metrics_dir: str, *, ran: bool = True) -> str:
    """The run directory with the commands that show it (TensorBoard, the analysis notebook).

    ``ran``: the run trained in this command, so ``<parent>/latest`` now points at it.
    """
    latest = point_latest_at(run_dir) if ran else None
    also = f" ({latest} points here)" if latest is not None else ""
    board = run_dir / metrics_dir / "tensorboard"
    return (
        f"results in {run_dir}{also}\n"
        f"  TensorBoard: .venv/bin/tensorboard --logdir {board.as_posix()}\n"
        f"  notebook:    .venv/bin/python scripts/analyze.py {run_dir}"
    )


def zero_reward_note(history: list[dict], experiment: ExperimentConfig) -> list[str]:
    """One or two lines when the reward was 0 at every step of ``history`` (else none)."""
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
    if not rewards or any(r != 0 for r in rewards):
        return []
    lines = [
        f"reward stayed 0 at all {len(rewards)} steps: no owner solved its task, so every "
        "advantage and gradient was 0 (nothing was learned, by design of the estimator)"
    ]
    if experiment.model.path == "tiny":
        lines.append(
            "expected here: the random tiny model never solves a desktop task; to watch reward "
            f"rise on a CPU in minutes, run the learning demo: .venv/bin/python {DEMO}"
        )
    else:
        lines.append(
            "the tasks may be too hard for this model: train on a band it sometimes solves "
            "(scripts/evaluate.py, then scripts/freeze_band.py)"
        )
    return lines


def recipe_hint(experiment: ExperimentConfig) -> str | None:
    """A hint for a preflight that fails on the seed's cluster parts (servers, absolute paths)."""
    absolute = [
        p
        for p in (experiment.model.path, experiment.data.task_set)
        if p.startswith("/") and not Path(p).exists()
    ]
    if experiment.server.launch != "none" and not absolute:
        return None
    return (
        "hint: the osworld_flash_* recipes name the seed's cluster (external SGLang servers, "
        f"/checkpoints, /data); on one GPU start from {ONE_GPU_RECIPE} (embedded server, its "
        "own paths), or point ModelSourceConfig.path / DataConfig.task_set / RolloutConfig.urls "
        "at yours"
    )


# ---- failures --------------------------------------------------------------------------------

_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory")
_JIT = re.compile(r"\bjit[_(](\w+)")  # jit_train_step, jit__prefill, jit(_decode)
_BYTES = re.compile(r"allocat\w*(?: request for)? (\d+) ?(?:bytes|B)\b")
_SIZE = re.compile(r"allocat\w*(?: request for)? (\d+(?:\.\d+)?) ?([KMGT])i?B?\b")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SERVER_PROGRAMS = ("prefill", "decode", "vision", "sample", "extend")
_UNAVAILABLE = re.compile(r"ServerUnavailable|no healthy server|ServerDisconnected")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def out_of_memory_line(text: str, *, where: str, in_server: bool) -> str | None:
    """One line for an XLA out-of-memory in ``text`` (an error message or a log's tail).

    Names the program (the ``jit_<name>`` in the message), what it tried to allocate, the knob
    that frees memory for it, and ``where`` the logs are. None when ``text`` has no OOM.

    >>> print(out_of_memory_line(
    ...     "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 29022806016 bytes. "
    ...     "... jit_train_step ...", where="runs/x", in_server=False))  # doctest: +ELLIPSIS
    error: out of device memory in jit_train_step (tried to allocate 27.03 GiB): ...; logs in runs/x
    """
    hits = [m for m in _OOM.finditer(text)]
    if not hits:
        return None
    tail = text[max(0, hits[0].start() - 2000) :]
    programs = [m.group(1) for m in _JIT.finditer(tail)]
    program = f"jit_{programs[-1]}" if programs else "a program"
    size = None
    if m := _BYTES.search(tail):
        size = _gib(int(m.group(1)))
    elif m := _SIZE.search(tail):
        size = _gib(float(m.group(1)) * _UNITS[m.group(2)])
    tried = f" (tried to allocate {size})" if size else ""
    server = in_server or any(p in program for p in _SERVER_PROGRAMS)
    knob = (
        "give the server more of the device (ServerConfig.device_memory_fraction), fewer "
        "requests at once (ServerConfig.max_running_requests) or shorter rows "
        "(CompactionConfig.max_context_tokens)"
        if server
        else "more micro-batches (TrainerConfig.num_micro_batches), ModelRuntimeConfig.remat = "
        "'full', shorter rows (RLConfig.length_buckets, CompactionConfig.max_context_tokens), "
        "or less of the device for the server (ServerConfig.device_memory_fraction)"
    )
    return f"error: out of device memory in {program}{tried}: {knob}; logs in {where}"


def _server_logs(run_dir: Path) -> list[Path]:
    return sorted(p for p in (*run_dir.glob("server.log"), *run_dir.glob("sglang_*.log")))


def _log_tail(path: Path, since: int = 0, size: int = 1 << 16) -> str:
    """The last ``size`` bytes of ``path`` written after offset ``since`` (this run's part)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(since, path.stat().st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    todo = [e]
    while todo:
        x = todo.pop(0)
        if any(x is y for y in out):
            continue
        out.append(x)
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        todo += list(getattr(x, "exceptions", ()))
    return out


def _server_failure(e: BaseException) -> BaseException | None:
    """The error of a rollout server that stopped answering (or exited) during the run."""
    for x in _chain(e):
        if isinstance(x, (EngineError, RefitError)):
            return x
        if isinstance(x, (SkippedStepsError, RolloutStepError)) and _UNAVAILABLE.search(str(x)):
            return x
    return None


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:limit]}" + ("..." if len(text) > limit else "")


def _resume_hint(run_dir: Path) -> str:
    steps = complete_checkpoints(run_dir)
    if steps:
        return f"rerun the same command to resume from checkpoint {steps[-1]}"
    return "rerun the same command to start again (no checkpoint yet)"


def failure_line(
    e: BaseException, run_dir: Path, log_offsets: dict[Path, int] | None = None
) -> str | None:
    """One line for a failure that is not a bug of this code (None: show the traceback).

    Storage (`rundir.storage_error`), a damaged checkpoint, a lost process of a multi-host job,
    an out of device memory (in the trainer, or in a rollout server's log after its offset in
    ``log_offsets``: this run's part), a rollout server that died.
    """
    if isinstance(e, (DistributedError, CorruptCheckpointError)):
        return f"error: {e}"
    err = storage_error(e)
    if err is not None:
        steps = complete_checkpoints(run_dir)
        kept = f"checkpoint {steps[-1]} is the last complete one" if steps else "no checkpoint yet"
        return f"error: {err} ({kept}; fix the storage and rerun the same command to resume)"
    where = _where_logs(run_dir)
    text = "\n".join(f"{type(x).__name__}: {x}" for x in _chain(e))
    oom = out_of_memory_line(text, where=where, in_server=False)
    if oom is not None:
        return oom
    rollouts = (RolloutError, SkippedStepsError, RolloutStepError)
    if any(isinstance(x, rollouts) for x in _chain(e)):  # the servers' side: their logs
        for log in _server_logs(run_dir):
            since = (log_offsets or {}).get(log, 0)
            oom = out_of_memory_line(_log_tail(log, since), where=where, in_server=True)
            if oom is not None:
                return oom
    server = _server_failure(e)
    if server is not None:  # its process gone, or not answering
        return (
            f"error: the rollout server stopped answering ({_first_line(server)}); "
            f"{_resume_hint(run_dir)}; logs in {where}"
        )
    return None


def _where_logs(run_dir: Path) -> str:
    """``run_dir (server.log, run.log, error.txt)``: the logs a failed run keeps (``error.txt``
    is written with the line that names it)."""  # noqa: D205, D209
    logs = [*_server_logs(run_dir), run_dir / RUN_LOG]
    names = [p.name for p in logs if p.exists()] + [ERROR_FILE]
    return f"{run_dir} ({', '.join(names)})"


class RunLog(logging.Handler):
    """The warnings and errors of a run (what stderr showed) appended to ``run_dir/run.log``.

    A handler on the root logger while the run runs; the file is opened on the first record
    once the run directory exists, and a write that fails is dropped (the run reports its
    storage itself).
    """

    def __init__(self, run_dir: Path) -> None:
        super().__init__(logging.WARNING)
        self.path = run_dir / RUN_LOG
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        """Appends ``record`` (nothing before the run directory exists)."""
        if not self.path.parent.is_dir():
            return
        try:
            with open(self.path, "a") as f:
                f.write(self.format(record) + "\n")
        except OSError:
            pass

    def __enter__(self) -> RunLog:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)


def _markers(run_dir: Path, metrics_dir: str) -> dict[Path, int]:
    paths = [p for pattern in STARTED for p in run_dir.glob(pattern)]
    paths.append(run_dir / metrics_dir / "metrics.jsonl")
    out = {}
    for p in paths:
        try:
            out[p] = p.stat().st_mtime_ns
        except OSError:
            continue
    return out


class StartWatch:
    """Whether a run got past its checks since this was made: it wrote a server log, weights,
    checkpoints, metrics or its ``experiment.json`` (`STARTED`), new or changed.

    A resumed directory holds these from earlier runs; only this run's writes count.
    """  # noqa: D205

    def __init__(self, run_dir: Path, metrics_dir: str = ".") -> None:
        self.run_dir, self.metrics_dir = run_dir, metrics_dir
        self.before = _markers(run_dir, metrics_dir)
        #: each server log's size at the start: what a failure reads is this run's part
        self.log_offsets = {p: p.stat().st_size for p in _server_logs(run_dir)}

    def started(self) -> bool:
        """Whether anything of `STARTED` was written since."""
        now = _markers(self.run_dir, self.metrics_dir)
        return any(self.before.get(p) != t for p, t in now.items())


def write_error(run_dir: Path, line: str, e: BaseException) -> Path | None:
    """Writes ``error.txt``: ``line``, then the traceback (None: the run dir refused it)."""
    path = run_dir / ERROR_FILE
    stamp = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ}"
    text = f"{line}\n\n{stamp}\n{''.join(traceback.format_exception(e))}"
    try:
        if run_dir.is_dir():
            path.write_text(text)
            return path
    except OSError:
        pass
    return None


def first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (None: ``path`` exists)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _forget(created: Path | None, watch: StartWatch) -> bool:
    """Removes what this command created when the run did not get past its checks."""
    if created is None or not created.is_dir() or watch.started():
        return False
    shutil.rmtree(created, ignore_errors=True)
    return True


# ---- the commands ----------------------------------------------------------------------------


def validate_only(experiment: ExperimentConfig) -> int:
    """``--validate_only``: the preflight and the memory estimate, nothing written or compiled.

    Prints what `rl.validate.validate` found; on a problem the estimate still (from ``config.json``
    alone), then the problems and, for the seed's cluster recipes, `recipe_hint`. Returns the
    exit code: 0 valid, 2 not.
    """
    from osworld_jax.rl.validate import ValidationError, validate

    print("config: ok")
    try:
        lines = validate(experiment)
    except ValidationError as e:
        if e.lines:
            print("\n".join(e.lines))
        print(f"error: {e}", file=sys.stderr)
        hint = recipe_hint(experiment)
        if hint is not None:
            print(hint, file=sys.stderr)
        return 2
    except OsworldJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print("valid: nothing was run or written (drop --validate_only to train)")
    return 0


def launch(request: RunRequest) -> int:
    """Plans, runs and reports the run of ``request``; returns the command's exit code.

    0: the run finished (or was already finished); 2: refused before anything started (a
    config, preflight or plan error, a changed config); 1: failed after it started (the run dir
    kept, the error in ``error.txt``); 130: interrupted.
    """
    exp, run_dir = request.experiment, request.run_dir
    metrics_dir = exp.rl.metrics_dir
    try:
        plan = plan_run(request)
    except (RunRefused, ConfigError) as e:  # ConfigError: its experiment.json is unreadable
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plan.finished:
        print(
            f"{run_dir} is finished: its checkpoint {plan.resume_from} is at or past the last "
            f"step ({request.last_step}); pass --steps=N with N > {plan.resume_from} to train "
            "further"
        )
        print(where_results_are(run_dir, metrics_dir, ran=False))
        return 0
    if plan.changes:
        changed = "; ".join(plan.changes)
        stamp = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ}"
        with open(run_dir / CONFIG_CHANGES_LOG, "a") as f:
            f.write(f"{stamp} resumed at checkpoint {plan.resume_from} with ")
            f.write(f"--allow_config_change: {changed}\n")
        print(f"config changed (logged in {run_dir / CONFIG_CHANGES_LOG}): {changed}")
    if plan.resume_from is not None:
        print(f"resuming from checkpoint {plan.resume_from}", flush=True)
    created = first_missing(run_dir)  # removed again by a start that is refused
    watch = StartWatch(run_dir, metrics_dir)
    print(f"run directory: {run_dir}", flush=True)
    try:
        quiet_storage_tracebacks()  # a full disk is reported below, once, as one line
        with RunLog(run_dir):
            result = train(exp, run_dir, request.steps, operative_gin=request.operative_gin)
    except KeyboardInterrupt:
        return _interrupted(request, created, watch)
    except Exception as e:
        return _failed(request, created, watch, e)
    _report(request, result)
    return 0


def _report(request: RunRequest, result: TrainResult) -> None:
    print(result.summary)
    for line in zero_reward_note(result.history, request.experiment):
        print(line)
    print(where_results_are(request.run_dir, request.experiment.rl.metrics_dir))


def _interrupted(request: RunRequest, created: Path | None, watch: StartWatch) -> int:
    run_dir = request.run_dir
    if not watch.started():
        gone = _forget(created, watch)
        print(f"interrupted before the run started{f'; removed {run_dir}' if gone else ''}",
              file=sys.stderr)  # fmt: skip
        return 130
    steps = complete_checkpoints(run_dir)
    if steps:
        print(f"interrupted; checkpoint {steps[-1]} in {run_dir} is intact", file=sys.stderr)
    else:
        print(f"interrupted before the first checkpoint; logs in {run_dir}", file=sys.stderr)
    print(where_results_are(run_dir, request.experiment.rl.metrics_dir), file=sys.stderr)
    return 130


def _is_refusal(e: Exception) -> bool:
    """A config, preflight or memory-plan error (raised before a run starts, as a rule)."""
    return isinstance(e, (ConfigError, TrainerError)) and not isinstance(
        e, (DistributedError, CorruptCheckpointError)
    )


def _failed(request: RunRequest, created: Path | None, watch: StartWatch, e: Exception) -> int:
    exp, run_dir = request.experiment, request.run_dir
    if _is_refusal(e) and not watch.started():  # nothing to look at: leave nothing
        _forget(created, watch)
        print(f"error: {e}", file=sys.stderr)
        hint = recipe_hint(exp) if isinstance(e, PreflightError) else None
        if hint is not None:
            print(hint, file=sys.stderr)
        return 2
    line = failure_line(e, run_dir, watch.log_offsets)  # complete: it says what to do
    if line is not None:
        write_error(run_dir, line, e)
        print(line, file=sys.stderr)
        return 1
    if isinstance(e, OsworldJaxError):  # its message says what (its first line here)
        lines = str(e).strip().splitlines() or [type(e).__name__]
        line = f"error: {lines[0]}" + (
            f" (+{len(lines) - 1} lines in error.txt)" if lines[1:] else ""
        )
    else:  # a bug: its traceback first
        traceback.print_exception(e)
        line = f"error: {_first_line(e)}"
    write_error(run_dir, line, e)
    print(f"{line} (logs in {_where_logs(run_dir)})", file=sys.stderr)
    return 1

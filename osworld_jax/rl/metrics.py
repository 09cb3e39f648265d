"""Run metrics: ``metrics.jsonl`` + TensorBoard events + a tqdm bar with per-stage timing.

One JSON object per step (``{"step": s, "time": ..., "reward/mean": ..., "time/rollout": ...}``);
the same scalars go to TensorBoard (an event file, `tb_events`, written synchronously: a full
disk fails the step that logs, not a background thread at exit). `StageTimer` measures the
stages of one step (``time/<stage>`` seconds); the bar shows the last step's reward and stage
times, and `summary` is printed at the end of the run.

While nothing moves (the first step's rollouts start the desktops and compile the server's
programs; its train step compiles; on a CPU that is minutes), the bar says what the run is
doing: `setting_up` during set-up, then `MetricsLogger.stage` with `stage_text` at each stage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tqdm

from osworld_jax.rl.rundir import _UNREADABLE, json_line, trim_partial_line, writing
from osworld_jax.rl.tb_events import EventFile

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
#: The stages of a step, in order (``time/<stage>`` metrics).
STAGES = (
    "data",
    "rollout",
    "segments",
    "advantages",
    "batch",
    "r3",
    "train",
    "refit",
    "checkpoint",
)


#: What the bar says during a stage (`stage_text`); the first step's words say why it is slow.
STAGE_WORDS = {
    "data": "drawing tasks",
    "rollout": "rollouts",
    "segments": "segments",
    "advantages": "advantages",
    "batch": "packing the batch",
    "train": "train step",
    "refit": "refit (weights to the server)",
    "checkpoint": "checkpoint",
}
FIRST_STEP_WORDS = {
    "rollout": "rollouts (desktops start + fork, the server compiles)",
    "train": "train step (compiling it)",
}
#: The set-up line (`setting_up`).
SETUP_TEXT = "setting up: model, preflight, rollout server, sandboxes, trainer"


def stage_text(step: int, name: str, *, first: bool) -> str:
    """What the bar says while stage ``name`` of ``step`` runs (``first``: this process's
    first step, where the compiles happen).

    >>> stage_text(1, "train", first=True)
    'step 1: train step (compiling it)'
    """  # noqa: D205
    words = (FIRST_STEP_WORDS if first else {}).get(name) or STAGE_WORDS.get(name, name)
    return f"step {step}: {words}"


class _Ticker:
    """Redraws a bar every ``every`` seconds from a daemon thread, so its elapsed time moves
    while a stage blocks (tqdm redraws only on updates; its redraw takes tqdm's lock)."""  # noqa: D205, D209

    def __init__(self, bar: tqdm.tqdm, every: float = 1.0) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not bar.disable:
            self._thread = threading.Thread(target=self._run, args=(bar, every), daemon=True)
            self._thread.start()

    def _run(self, bar: tqdm.tqdm, every: float) -> None:
        while not self._stop.wait(every):
            bar.refresh()

    def stop(self) -> None:
        """Stops the redraws (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


@contextlib.contextmanager
def setting_up(enabled: bool = True) -> Iterator[None]:
    """A status line (`SETUP_TEXT` and the time spent) while a run sets up; cleared after."""
    with tqdm.tqdm(
        total=None,
        bar_format="{desc} [{elapsed}]",
        desc=SETUP_TEXT,
        leave=False,
        disable=not enabled,
    ) as line:
        ticker = _Ticker(line)
        try:
            line.refresh()
            yield
        finally:
            ticker.stop()


class StageTimer:
    """Wall-clock seconds per named stage of one step.

    Args:
      on_stage: called with each stage's name as it starts (the progress line).
    """

    def __init__(self, on_stage: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, tuple[float, float]] = {}  # name -> first start, last end
        self._on_stage = on_stage

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Times the ``with`` body, adding to ``seconds[name]`` (and its ``spans`` entry)."""
        if self._on_stage is not None:
            self._on_stage(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + t1 - t0
            self.spans[name] = (self.spans.get(name, (t0, t1))[0], t1)

    def metrics(self) -> dict[str, float]:
        """``time/<stage>`` for every timed stage plus ``time/step`` (their sum)."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(self.seconds.values())
        return out


def _scalar(v: Any) -> float | int | None:
    if isinstance(v, bool | np.bool_):
        return int(v)
    if isinstance(v, int | np.integer):
        return int(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


class MetricsLogger:
    """Writes step metrics to JSONL and TensorBoard and drives the progress bar.

    Args:
      directory: where ``metrics.jsonl`` and the event files go (created).
      total_steps: the run's last step (for the bar).
      initial_step: the first step of this process (a resumed run starts past 0).
      progress_bar: show the tqdm bar.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        total_steps: int,
        initial_step: int = 0,
        progress_bar: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        trim_partial_line(self.directory / METRICS_FILE)  # a full disk may have cut it short
        self._jsonl = open(self.directory / METRICS_FILE, "a", buffering=1)  # noqa: SIM115
        self._tb_dir = self.directory / "tensorboard"
        self._tb_dir.mkdir(exist_ok=True)
        with writing(self._tb_dir):
            self._tb = EventFile(self._tb_dir)
        self._tb_closed = False
        self._bar = tqdm.tqdm(
            total=total_steps,
            initial=initial_step,
            disable=not progress_bar,
            unit="step",
            dynamic_ncols=True,
        )
        self._ticker = _Ticker(self._bar)
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records the metrics of ``step`` (non-scalar values go to JSONL only)."""
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for k, v in metrics.items():
            s = _scalar(v)
            record[k] = v if s is None else s
            if s is not None and math.isfinite(s):
                with writing(self._tb_dir):
                    self._tb.scalar(k, s, step)
        with writing(self._jsonl.name):
            self._jsonl.write(json.dumps(record, default=_json_default) + "\n")
        with writing(self._tb_dir):
            self._tb.flush()
        self.history.append(record)
        self._bar.set_postfix_str(_postfix(record), refresh=False)
        self._bar.update(1)

    def stage(self, text: str) -> None:
        """Shows ``text`` (what the run does now, `stage_text`) before the bar."""
        self._bar.set_description_str(text)

    def summary(self) -> str:
        """A few lines: steps, first/last reward, pass rate, mean stage times, programs built."""
        if not self.history:
            return "no step completed"
        first, last = self.history[0], self.history[-1]
        stage = {s: float(np.mean([h.get(f"time/{s}", 0.0) for h in self.history])) for s in STAGES}
        stage_txt = " ".join(f"{s}={t:.1f}s" for s, t in stage.items() if t > 0)
        programs = []
        if "compile/programs" in first:  # `metrics_step.compile_metrics`
            later = sum(h.get("compile/programs", 0.0) for h in self.history[1:])
            programs = [
                f"programs in this process: step {first['step']} built "
                f"{first['compile/programs']:.0f} "
                f"({first.get('compile/cache_hits', 0.0):.0f} from the compilation cache; "
                f"{first.get('compile/seconds', 0.0):.1f} s compiling or loading, "
                f"{first.get('compile/trace_lower_seconds', 0.0):.1f} s tracing), later steps "
                f"{later:.0f}"
            ]
        return "\n".join(
            [
                f"steps {first['step']}..{last['step']} ({len(self.history)} this run)",
                f"reward/mean {first.get('reward/mean', float('nan')):.3f} -> "
                f"{last.get('reward/mean', float('nan')):.3f}; pass_rate "
                f"{last.get('reward/pass_rate', float('nan')):.3f}; failed owners "
                f"{sum(h.get('owners/failed', 0) for h in self.history)}",
                f"mean stage time: {stage_txt}",
                *programs,
            ]
        )

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flushes and closes every writer (idempotent; each is closed even if another fails)."""
        self._ticker.stop()
        if not self._bar.disable:
            self._bar.set_description_str("", refresh=False)
        self._bar.close()
        try:
            if not self._tb_closed:
                self._tb_closed = True
                with writing(self._tb_dir):
                    self._tb.close()
        finally:
            if not self._jsonl.closed:
                with writing(self._jsonl.name):
                    self._jsonl.close()


def _postfix(record: Mapping[str, Any]) -> str:
    parts = [f"r={record.get('reward/mean', float('nan')):.2f}"]
    for s in STAGES:
        t = record.get(f"time/{s}")
        if t is not None and t >= 0.05:
            parts.append(f"{s}={t:.1f}s")
    return " ".join(parts)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    return str(o)


def read_metrics(run_dir_or_file: str | Path) -> list[dict[str, Any]]:
    """Reads ``metrics.jsonl`` (a later record of the same step replaces an earlier one).

    A line that does not parse, or has no integer ``step``, is skipped with a warning naming
    the file and line.
    """
    p = Path(run_dir_or_file)
    if p.is_dir():
        p = p / METRICS_FILE
    by_step: dict[int, dict[str, Any]] = {}
    with open(p, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json_line(line, p, n)
            step = rec.get("step") if isinstance(rec, dict) else None
            if type(step) is not int:
                if rec is not _UNREADABLE:
                    log.warning("%s:%d: a record without an integer step skipped", p, n)
                continue
            by_step[step] = rec
    return [by_step[s] for s in sorted(by_step)]

"""Compare our evaluator metrics with upstream OSWorld's own functions on identical inputs.

Two steps, because the two sides live in different Python environments:

1. ``record`` (this repository's venv) runs the metric tests (``tests/env/evaluators``) with this
   file as a pytest plugin: every metric call's arguments (files copied aside), options and our
   score are written to ``OUT/calls.json``::

       .venv/bin/python scripts/upstream_parity.py record /tmp/parity [--source apps]

   (``--source apps``: the calls on files LibreOffice and GIMP made in a jailed desktop.)

2. ``replay`` (a venv with upstream's requirements, e.g. ``pip install desktop-env``, or a
   checkout's ``requirements.txt``) calls upstream's function of the same name on the same
   arguments and prints the agreement per metric and every disagreement::

       /path/to/osworld-venv/bin/python scripts/upstream_parity.py replay /tmp/parity \\
           --upstream /path/to/OSWorld

   Modules upstream imports but these metrics never call (``easyocr``, ``borb``, ``acoustid``,
   ``playwright``, ``pydrive``) are stubbed when missing.

A disagreement is expected where upstream raises (we score 0) and for the deliberate
differences listed in ``docs/EVALUATORS.md``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

_OUT_ENV = "OSWORLD_JAX_PARITY_OUT"
_calls: list[dict[str, Any]] = []


# ------------------------------------------------------------------ record (pytest plugin)


def _keep(value: Any, files: Path) -> Any:
    """Copies a file argument (with its directory's other files) to ``files``; returns the copy."""
    if isinstance(value, str) and os.path.isfile(value) and not value.startswith(str(files)):
        dest = files / str(len(list(files.iterdir())))
        dest.mkdir(parents=True)
        src = Path(value).parent
        for p in src.iterdir():
            if p.is_file():
                shutil.copy(p, dest)
        return str(dest / Path(value).name)
    if isinstance(value, list):
        return [_keep(v, files) for v in value]
    return value


def _wrap(name: str, fn: Any, files: Path) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        err = None
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            out, err = None, e
        try:
            _calls.append(
                {
                    "metric": name,
                    "args": [_keep(a, files) for a in args],
                    "kwargs": kwargs,
                    "ours": None if out is None else float(out),
                    "error": None if err is None else type(err).__name__,
                }
            )
            json.dumps(_calls[-1])
        except (TypeError, ValueError):
            _calls.pop()  # an argument that is not JSON (a parsed object): not replayable
        if err is not None:
            raise err
        return out

    for attr in ("unsupported_options",):
        if hasattr(fn, attr):
            setattr(recorded, attr, getattr(fn, attr))
    return recorded


def pytest_configure(config: Any) -> None:
    """Wraps every registered metric (plugin mode, ``record``)."""
    out = os.environ.get(_OUT_ENV)
    if not out:
        return
    from osworld_jax.env.evaluators import METRICS

    files = Path(out) / "files"
    files.mkdir(parents=True, exist_ok=True)
    for name in METRICS.names():
        METRICS._items[name] = _wrap(name, METRICS._items[name], files)


def pytest_sessionfinish(session: Any) -> None:
    """Writes the recorded calls (plugin mode)."""
    out = os.environ.get(_OUT_ENV)
    if out:
        Path(out, "calls.json").write_text(json.dumps(_calls))


def record(out: Path, source: str | None = None) -> int:
    """Runs the metric tests with this file as a plugin, recording into ``out``.

    ``source``: only this fixture source (``tests/env/evaluators/sources.py``; ``apps`` records
    the calls on files the real applications made, which needs ``--runslow``).
    """
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **({"OSWORLD_JAX_FIXTURE_SOURCE": source} if source else {}),
        _OUT_ENV: str(out.resolve()),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "upstream_parity", "tests/env/evaluators"]
    if source:
        cmd.append("--runslow")
    rc = subprocess.call(cmd, env=env, cwd=Path(__file__).resolve().parents[1])
    n = len(json.loads((out / "calls.json").read_text()))
    print(f"recorded {n} metric calls in {out / 'calls.json'} (pytest exit {rc})")
    return 0


# ------------------------------------------------------------------ replay (upstream's venv)


def _upstream_metrics(root: Path) -> Any:
    sys.path.insert(0, str(root))
    for name in (
        "easyocr",
        "acoustid",
        "borb",
        "borb.pdf",
        "playwright",
        "playwright.sync_api",
        "pydrive",
        "pydrive.auth",
        "pydrive.drive",
    ):
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            for attr in (
                "Document",
                "PDF",
                "sync_playwright",
                "expect",
                "TimeoutError",
                "GoogleAuth",
                "GoogleDrive",
                "GoogleDriveFileList",
                "GoogleDriveFile",
            ):
                setattr(stub, attr, object)
            sys.modules[name] = stub
    import logging

    logging.disable(logging.CRITICAL)
    from desktop_env.evaluators import metrics  # type: ignore[import-not-found]

    return metrics


def replay(out: Path, upstream: Path) -> int:
    """Calls upstream's metrics on the recorded inputs and prints the agreement."""
    metrics = _upstream_metrics(upstream)
    calls = json.loads((out / "calls.json").read_text())
    per: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    rows = []
    for c in calls:
        fn = getattr(metrics, c["metric"], None)
        if fn is None:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                up, up_err = fn(*c["args"], **c["kwargs"]), None
        except Exception as e:  # noqa: BLE001 - upstream's crash is a result here
            up, up_err = None, f"{type(e).__name__}: {str(e)[:80]}"
        same = (c["error"] is not None and up_err is not None) or (
            c["error"] is None
            and up_err is None
            and up is not None
            and c["ours"] is not None
            and abs(float(up) - c["ours"]) < 1e-9
        )
        per[c["metric"]][0 if same else 1] += 1
        if not same:
            rows.append(f"{c['metric']}: ours={c['ours']} ({c['error']}) upstream={up} ({up_err})")
    agree = sum(a for a, _ in per.values())
    print(f"agree {agree} of {agree + sum(d for _, d in per.values())} metric calls")
    for name, (a, d) in sorted(per.items()):
        if d:
            print(f"  {name}: {a} agree, {d} differ")
    print("\n".join(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--source", default=None, help="one fixture source only (e.g. apps)")
    rp = sub.add_parser("replay")
    rp.add_argument("out", type=Path)
    rp.add_argument("--upstream", type=Path, required=True, help="an OSWorld checkout")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        return record(args.out, args.source)
    return replay(args.out, args.upstream)


if __name__ == "__main__":
    sys.exit(main())

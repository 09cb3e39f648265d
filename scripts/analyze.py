#!/usr/bin/env python
"""Execute the analysis notebook on a run directory; the result is ``<run_dir>/analysis.ipynb``.

Examples:

  python scripts/analyze.py runs/latest        # the newest run of scripts/train.py
  python scripts/analyze.py runs/20261203-101500 --out=report.ipynb

Needs the notebook tools (the ``[analysis]`` extra, which ``scripts/setup.sh`` installs).
Open the result with any notebook viewer (VS Code, ``jupyter lab``), or edit the source,
``notebooks/analysis.py`` (jupytext percent format), with ``OSWORLD_RUN_DIR`` set.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from osworld_jax import cliargs

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "analysis.py"


def main(argv: list[str] | None = None) -> int:
    p = cliargs.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dir", help="a run directory of scripts/train.py (e.g. runs/latest)")
    p.add_argument(
        "--out", type=cliargs.output_file, default=None, help="default <run_dir>/analysis.ipynb"
    )
    p.add_argument("--timeout", type=cliargs.positive_int, default=600, help="seconds per cell")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"error: {args.run_dir}: no metrics.jsonl (not a run directory)", file=sys.stderr)
        return 2
    try:
        import jupyter_client
        import jupytext
        import nbclient
        import nbformat
    except ImportError as e:
        print(f"error: {e.name} is missing: pip install -e '.[analysis]'", file=sys.stderr)
        return 2
    os.environ["OSWORLD_RUN_DIR"] = str(run_dir)  # the kernel inherits it
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend draws the figures
    nb = jupytext.read(NOTEBOOK)
    # the kernel talks over local sockets (IPC, in a temporary directory), not TCP: nothing
    # listens on the network, and the kernel has no "running over TCP without encryption" warning
    sockets = tempfile.TemporaryDirectory(prefix="osworld_jax-kernel-")
    km = jupyter_client.KernelManager(
        kernel_name="python3", transport="ipc", ip=str(Path(sockets.name) / "kernel")
    )
    client = nbclient.NotebookClient(
        nb, km=km, timeout=args.timeout, resources={"metadata": {"path": str(REPO)}}
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        print(f"error: the notebook failed on {run_dir}: {str(e).strip().splitlines()[-1]}",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if km.has_kernel:  # a kernel manager given to nbclient is ours to shut down
            km.shutdown_kernel()
        sockets.cleanup()
    out = Path(args.out) if args.out else run_dir / "analysis.ipynb"
    nbformat.write(nb, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

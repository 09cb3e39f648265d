"""Running a short trusted Python program inside the desktop and reading its JSON answer.

Getters and setup steps that need more than the in-VM protocol's routes (a directory tree, the
browser's DevTools endpoint, VLC's HTTP interface, a window's size) run their own program inside
the desktop with the system ``python3`` — OSWorld's VM and the local jail both have one — so they
behave the same on every backend and reach services on the desktop's private network.

The program runs with ``python3 -I`` (isolated mode): no ``PYTHON*`` variables, no user
site-packages, no ``usercustomize``/``sitecustomize`` from the agent-writable home, no current
directory on ``sys.path``, so files the agent planted cannot run inside the evaluator's program.
"""

from __future__ import annotations

import json
from typing import Any

from osworld_jax.env.backend import SandboxEvalError
from osworld_jax.env.protocol import VMProtocol


async def run_python(
    vm: VMProtocol, code: str, *args: str, error: type[Exception] = SandboxEvalError
) -> Any:
    """Runs ``python3 -I -c code args...`` in the desktop; returns its last stdout line as JSON.

    Raises:
      error: (``SandboxEvalError`` by default) the program failed or printed no JSON.
    """
    r = await vm.execute(["python3", "-I", "-c", code, *args])
    out = str(r.get("output") or "").strip()
    if r.get("returncode") not in (0, None) or not out:
        tail = str(r.get("error") or "").strip().splitlines()[-1:] or [f"rc={r.get('returncode')}"]
        raise error(f"python in the desktop failed: {tail[0][:200]}")
    try:
        return json.loads(out.splitlines()[-1])
    except json.JSONDecodeError as e:
        raise error(f"python in the desktop printed no JSON: {out[:200]!r}") from e

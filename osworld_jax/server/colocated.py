"""The embedded server inside the trainer's process: its weights arrive as device arrays.

`ColocatedServer` runs the same server as ``python -m osworld_jax.server.serve`` (the same flags,
routes, engine and wire contract: clients talk to its HTTP port as to any SGLang), on a thread
of the trainer's process, sharing the trainer's jax client and devices. A refit is then a
hand-over: the trainer casts its parameters to the served dtype on the device and stages them
(`ColocatedServer.stage`), and the usual refit requests (pause -> flush -> update -> continue)
name the staged handle in ``/update_weights_from_tensor`` (`STAGED_FORMAT`): the engine swaps
its parameter tree for the staged one between two steps, no file, no host copy, and no second
copy where the layouts agree (`EngineWeights.update_weights_from_params`). See docs/DESIGN.md
"Refit".

It behaves like a `osworld_jax.rollout.launch.ServerProcess` for the run (``spawn``,
``wait_ready``, ``stop``, ``url``), so a `ServerGroup` holds it like a subprocess.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from osworld_jax.contract.errors import EngineError
from osworld_jax.contract.refit import STAGED_FORMAT, TensorWeights
from osworld_jax.server.http_base import ENGINE_KEY, EngineHolder
from osworld_jax.server.serve import engine_config, parse_args, serve
from osworld_jax.server.staging import Staging

log = logging.getLogger(__name__)


class ColocatedServer:
    """The embedded server on a thread of this process (a context manager).

    Args:
      argv: ``osworld_jax.server.serve`` flags (``--port 0``: a free port).
      memory_budget_bytes: what its weights and KV cache may hold of the shared device (None:
        no budget of its own).
      startup_timeout_s: how long `wait_ready` waits for the engine.
      log_path: a file that gets the server's log records (the run's ``server.log``).

    Attributes:
      url: ``http://host:port`` once `spawn` returned.
      name: what it is called in errors.
    """

    name = "colocated server"

    def __init__(
        self,
        argv: Sequence[str],
        *,
        memory_budget_bytes: float | None = None,
        startup_timeout_s: float = 600.0,
        log_path: str | Path | None = None,
    ) -> None:
        self.args = parse_args(list(argv))
        self.memory_budget_bytes = memory_budget_bytes
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.staging = Staging()
        # the URL is known before the port opens unless the port is 0 (then: after `spawn`)
        self.url = f"http://{self.args.host}:{self.args.port}" if self.args.port else ""
        self._holder: EngineHolder | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._error: BaseException | None = None
        self._log_handler: logging.Handler | None = None
        self._log_state = (logging.NOTSET, True)

    # ------------------------------------------------------------------ lifecycle

    def spawn(self) -> None:
        """Opens the port on a thread of its own; the engine loads there (see `wait_ready`)."""
        if self.log_path is not None:
            self._log_handler = logging.FileHandler(self.log_path)
            self._log_handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            )
            logger = logging.getLogger("osworld_jax.server")
            self._log_state = (logger.level, logger.propagate)
            logger.setLevel(logging.INFO)
            logger.propagate = False  # the run's console keeps the trainer's lines
            logger.addHandler(self._log_handler)
        config = dataclasses.replace(
            engine_config(self.args), memory_budget_bytes=self.memory_budget_bytes
        )

        def on_listening(app: web.Application, url: str) -> None:
            self._holder, self.url = app[ENGINE_KEY], url
            self._listening.set()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(
                self.args,
                stop=self._stop,
                staging=self.staging,
                config=config,
                on_listening=on_listening,
            )

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as e:  # reported by wait_ready / stop
                self._error = e
                self._listening.set()

        self._thread = threading.Thread(target=run, name="osworld-jax-colocated", daemon=True)
        self._thread.start()
        if not self._listening.wait(60.0) or self._error is not None:
            raise EngineError(f"the {self.name} could not open its port: {self._error!r}")

    def wait_ready(self) -> None:
        """Waits until the engine serves; raises `EngineError` if it failed to start."""
        deadline = time.monotonic() + self.startup_timeout_s
        assert self._holder is not None and self._thread is not None
        while time.monotonic() < deadline:
            if self._holder.error is not None:
                raise EngineError(f"the {self.name}: {self._holder.error}")
            if self._error is not None or not self._thread.is_alive():
                raise EngineError(f"the {self.name} stopped: {self._error!r}")
            if self._holder.engine is not None:
                return
            time.sleep(0.05)
        raise EngineError(f"the {self.name} did not start within {self.startup_timeout_s} s")

    def stop(self) -> None:
        """Closes the port and stops the engine (waits for its thread)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout=60.0)
            self._thread = None
        if self._log_handler is not None:
            logger = logging.getLogger("osworld_jax.server")
            logger.removeHandler(self._log_handler)
            logger.setLevel(self._log_state[0])
            logger.propagate = self._log_state[1]
            self._log_handler.close()
            self._log_handler = None

    def __enter__(self) -> ColocatedServer:
        self.spawn()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ weights

    @property
    def dtype(self) -> str:
        """The served parameters' dtype (the ``--dtype`` flag resolved)."""
        return engine_config(self.args).dtype

    @property
    def served_params(self) -> Any:
        """The parameter tree the engine serves now (read-only; tests and digests)."""
        assert self._holder is not None and self._holder.engine is not None
        return self._holder.engine.runner.params

    def stage(self, params: Any, *, expected_digest: str | None = None) -> TensorWeights:
        """Stages ``params`` (already the served dtype, on the device) for a refit.

        Returns the refit's `TensorWeights` (one bucket: the handle, `STAGED_FORMAT`), for
        ``SGLangClient.refit``. The trainer must not donate or delete these arrays afterwards:
        once the refit took them they are what the server serves.
        """
        handle = self.staging.put(params)
        return TensorWeights(
            buckets=((handle,),),
            load_format=STAGED_FORMAT,
            expected_digest=expected_digest,
            label="staged in-process arrays",
        )


def server_program_memory(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The server's compiled programs' memory in this process (a colocated server's plan).

    ``request`` is what ``python -m osworld_jax.server.program_memory`` takes (``model_path``,
    the cache layout and `server_programs`' keywords); returns one dict per program.
    """
    from osworld_jax.model import Qwen3MoeConfig
    from osworld_jax.model.serving import CacheLayout
    from osworld_jax.server.program_memory import server_programs

    args = dict(request)
    model = Qwen3MoeConfig.from_json(Path(args.pop("model_path")) / "config.json")
    layout = CacheLayout(args.pop("context_length"), args.pop("slots"), args.pop("slot_len"))
    return [dataclasses.asdict(p) for p in server_programs(model, layout, **args)]
